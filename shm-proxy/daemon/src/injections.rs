//! The injection probes' verdicts (`report-injection`, sent by the init
//! container the webhook adds per distinct image of a pod, `deploy/probe`):
//! which containers of which pod load the preload library and which stay on
//! plain TCP, and why. Shown by `flowlane status`.
//!
//! Every field comes from a pod: strings are cut to a bound, the container
//! list too, and the table holds a bounded number of verdicts per pod and in
//! all; a pod that left the registry loses its verdicts.

use std::collections::BTreeMap;

use flowlane_lane::proto::{InjectionInfo, InjectionVerdict};

use crate::pods::PodId;

/// Longest string kept (bytes, cut at a character boundary).
const MAX_TEXT: usize = 256;
/// Most container names kept per verdict.
const MAX_CONTAINERS: usize = 32;
/// Most verdicts kept per pod (one per distinct image; the webhook adds at
/// most 32 probes).
const MAX_PER_POD: usize = 32;
/// Most verdicts kept in all.
const MAX_TOTAL: usize = 16384;

/// One verdict as reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub verdict: InjectionVerdict,
    pub libc: String,
    pub reason: String,
}

/// Verdicts by pod, then by the container names they cover.
#[derive(Debug, Default)]
pub struct Injections {
    by_pod: BTreeMap<PodId, BTreeMap<Vec<String>, Verdict>>,
    total: usize,
}

fn cut(s: &str) -> String {
    let mut end = s.len().min(MAX_TEXT);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

impl Injections {
    /// Records `pod`'s verdict for `containers` (a later one for the same
    /// containers replaces it). False when a bound refused it.
    pub fn record(
        &mut self,
        pod: PodId,
        containers: &[String],
        verdict: InjectionVerdict,
        libc: &str,
        reason: &str,
    ) -> bool {
        let key: Vec<String> = containers
            .iter()
            .take(MAX_CONTAINERS)
            .map(|c| cut(c))
            .collect();
        let entry = Verdict {
            verdict,
            libc: cut(libc),
            reason: cut(reason),
        };
        let per_pod = self.by_pod.entry(pod).or_default();
        if !per_pod.contains_key(&key) {
            if per_pod.len() >= MAX_PER_POD || self.total >= MAX_TOTAL {
                if per_pod.is_empty() {
                    self.by_pod.remove(&pod);
                }
                return false;
            }
            self.total += 1;
        }
        per_pod.insert(key, entry);
        true
    }

    /// Forgets the verdicts of pods for which `live` is false.
    pub fn retain(&mut self, live: impl Fn(PodId) -> bool) {
        self.by_pod.retain(|pod, _| live(*pod));
        self.total = self.by_pod.values().map(BTreeMap::len).sum();
    }

    /// Every verdict of the pods `name` knows, with their display names.
    pub fn list(&self, name: impl Fn(PodId) -> Option<String>) -> Vec<InjectionInfo> {
        self.by_pod
            .iter()
            .filter_map(|(pod, verdicts)| Some((name(*pod)?, verdicts)))
            .flat_map(|(pod, verdicts)| {
                verdicts.iter().map(move |(containers, v)| InjectionInfo {
                    pod: pod.clone(),
                    containers: containers.clone(),
                    verdict: v.verdict,
                    libc: v.libc.clone(),
                    reason: v.reason.clone(),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_later_verdict_replaces_and_pods_that_left_are_forgotten() {
        let mut t = Injections::default();
        assert!(t.record(7, &names(&["app"]), InjectionVerdict::Tcp, "musl", "musl"));
        assert!(t.record(
            7,
            &names(&["app"]),
            InjectionVerdict::Lane,
            "glibc 2.36",
            "ok"
        ));
        assert!(t.record(
            8,
            &names(&["a", "b"]),
            InjectionVerdict::Tcp,
            "none",
            "static"
        ));
        let l = t.list(|p| Some(format!("ns/pod{p}")));
        assert_eq!(l.len(), 2);
        assert_eq!(l[0].pod, "ns/pod7");
        assert_eq!(l[0].verdict, InjectionVerdict::Lane);
        assert_eq!(l[1].containers, names(&["a", "b"]));
        t.retain(|p| p == 8);
        assert_eq!(t.list(|p| Some(p.to_string())).len(), 1);
    }

    #[test]
    fn hostile_reports_are_bounded() {
        let mut t = Injections::default();
        let long = "é".repeat(1000);
        let many: Vec<String> = (0..1000).map(|i| format!("c{i}")).collect();
        assert!(t.record(1, &many, InjectionVerdict::Tcp, &long, &long));
        let l = t.list(|p| Some(p.to_string()));
        assert!(l[0].libc.len() <= MAX_TEXT && l[0].reason.len() <= MAX_TEXT);
        assert_eq!(l[0].containers.len(), MAX_CONTAINERS);
        for i in 0..MAX_PER_POD + 5 {
            t.record(
                2,
                &names(&[&format!("x{i}")]),
                InjectionVerdict::Lane,
                "",
                "",
            );
        }
        assert_eq!(
            t.list(|p| Some(p.to_string()))
                .iter()
                .filter(|v| v.pod == "2")
                .count(),
            MAX_PER_POD
        );
    }
}
