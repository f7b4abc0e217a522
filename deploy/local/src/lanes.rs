//! Which lane a run really used, from the node daemons' own counters
//! (`flowlane status --json --socket PATH`), read before and after a run.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use flowlane_workloads::report::LaneEvidence;
use serde_json::Value;

use crate::spec::Binaries;

/// The counters of one daemon that tell lanes apart.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    pub shm_opened: u64,
    pub shm_bytes: u64,
    /// Connections left on TCP, by the daemon's reason.
    pub fallbacks: BTreeMap<String, u64>,
    /// Connections opened, by lane (`shm`, `relay`, ...).
    pub opened_by_lane: BTreeMap<String, u64>,
}

/// What changed between two readings of every daemon, by lane.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LaneDeltas {
    /// Every daemon answered both times (else nothing may be claimed).
    pub counters_read: bool,
    pub opened: BTreeMap<String, u64>,
    pub fallback_reasons: BTreeMap<String, u64>,
}

/// Reads a daemon's counters; `None` when the daemon or the status command
/// does not answer (then nothing may be claimed about lanes).
pub fn read(bins: &Binaries, socket: &Path) -> Option<Counters> {
    let out = Command::new(bins.flowlane())
        .args(["status", "--json", "--socket"])
        .arg(socket)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    parse(&v)
}

/// Extracts the counters from `flowlane status --json` (the daemon's stats
/// answer, possibly wrapped in an object under `stats`).
pub fn parse(v: &Value) -> Option<Counters> {
    let stats = if v.get("lanes").is_some() {
        v
    } else {
        v.get("stats")?
    };
    let shm = stats.get("lanes")?.get("shm");
    let num = |x: Option<&Value>| x.and_then(Value::as_u64).unwrap_or(0);
    let fallbacks = stats
        .get("fallbacks")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_u64()?)))
                .collect()
        })
        .unwrap_or_default();
    let opened_by_lane = stats
        .get("lanes")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(lane, l)| (lane.clone(), num(l.get("connections_opened"))))
                .collect()
        })
        .unwrap_or_default();
    Some(Counters {
        shm_opened: num(shm.and_then(|s| s.get("connections_opened"))),
        shm_bytes: num(shm.and_then(|s| s.get("bytes"))),
        fallbacks,
        opened_by_lane,
    })
}

fn add_deltas(
    into: &mut BTreeMap<String, u64>,
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
) {
    for (k, n) in after {
        let d = n.saturating_sub(before.get(k).copied().unwrap_or(0));
        if d > 0 {
            *into.entry(k.clone()).or_default() += d;
        }
    }
}

/// Per-lane differences summed over all nodes (the connectivity check).
pub fn evidence_by_lane(before: &[Option<Counters>], after: &[Option<Counters>]) -> LaneDeltas {
    let mut d = LaneDeltas {
        counters_read: !before.is_empty() && before.len() == after.len(),
        ..Default::default()
    };
    for (b, a) in before.iter().zip(after) {
        match (b, a) {
            (Some(b), Some(a)) => {
                add_deltas(&mut d.opened, &b.opened_by_lane, &a.opened_by_lane);
                add_deltas(&mut d.fallback_reasons, &b.fallbacks, &a.fallbacks);
            }
            _ => d.counters_read = false,
        }
    }
    d
}

/// Sums the differences over all nodes; no evidence unless every daemon
/// answered both times.
pub fn evidence(before: &[Option<Counters>], after: &[Option<Counters>]) -> LaneEvidence {
    let mut e = LaneEvidence {
        counters_read: !before.is_empty() && before.len() == after.len(),
        ..Default::default()
    };
    for (b, a) in before.iter().zip(after) {
        match (b, a) {
            (Some(b), Some(a)) => {
                e.shm_connections += a.shm_opened.saturating_sub(b.shm_opened);
                e.shm_bytes += a.shm_bytes.saturating_sub(b.shm_bytes);
                let mut reasons = BTreeMap::new();
                add_deltas(&mut reasons, &b.fallbacks, &a.fallbacks);
                for (reason, d) in reasons {
                    e.tcp_fallbacks += d;
                    *e.fallback_reasons.entry(reason).or_default() += d;
                }
            }
            _ => e.counters_read = false,
        }
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_daemon_stats() {
        let v = json!({"daemon": {}, "lanes": {"shm": {"connections_opened": 4, "bytes": 1000}},
                       "fallbacks": {"no-listener": 2, "not-local-pod": 1}});
        let c = parse(&v).unwrap();
        assert_eq!((c.shm_opened, c.shm_bytes), (4, 1000));
        assert_eq!(c.fallbacks.values().sum::<u64>(), 3);
        assert_eq!(c.opened_by_lane.get("shm"), Some(&4));
        assert_eq!(parse(&json!({"stats": v})).unwrap(), c);
        assert!(parse(&json!({"other": 1})).is_none());
    }

    #[test]
    fn missing_daemon_means_no_evidence() {
        let c = Some(Counters {
            shm_opened: 1,
            shm_bytes: 5,
            fallbacks: BTreeMap::from([("no-listener".to_string(), 2)]),
            ..Default::default()
        });
        let e = evidence(&[c.clone(), None], &[c.clone(), None]);
        assert!(!e.counters_read);
        let later = Some(Counters {
            shm_opened: 3,
            shm_bytes: 50,
            fallbacks: BTreeMap::from([
                ("no-listener".to_string(), 2),
                ("not-local-pod".to_string(), 1),
            ]),
            ..Default::default()
        });
        let e = evidence(&[c], &[later]);
        assert!(e.counters_read);
        assert_eq!(
            (e.shm_connections, e.shm_bytes, e.tcp_fallbacks),
            (2, 45, 1)
        );
        assert_eq!(e.fallback_reasons.get("not-local-pod"), Some(&1));
    }
}
