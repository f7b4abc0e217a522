//! The diagnosis as data: sections of findings, each with a stable id,
//! a severity, what was seen and what to do about it. Rendered for people
//! (aligned text) or for programs (`--json`).

use serde::Serialize;
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Checked and fine.
    Ok,
    /// Worth knowing, nothing to fix.
    Info,
    /// Works, but degraded or about to break.
    Warning,
    /// Broken: `flowlane diag` exits non-zero.
    Error,
}

impl Severity {
    fn label(self) -> &'static str {
        match self {
            Severity::Ok => "ok",
            Severity::Info => "info",
            Severity::Warning => "WARN",
            Severity::Error => "ERROR",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// Stable identifier, e.g. `ipam.leaked_lease` (what scripts match on).
    pub id: &'static str,
    pub severity: Severity,
    pub summary: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Section {
    pub name: &'static str,
    pub title: String,
    pub findings: Vec<Finding>,
    /// Machine-readable details of the section (inventory, leases, ...).
    #[serde(skip_serializing_if = "Value::is_null")]
    pub data: Value,
}

impl Section {
    pub fn new(name: &'static str, title: impl Into<String>) -> Self {
        Section {
            name,
            title: title.into(),
            findings: Vec::new(),
            data: Value::Null,
        }
    }

    fn push(&mut self, id: &'static str, severity: Severity, summary: String, fix: Option<String>) {
        self.findings.push(Finding {
            id,
            severity,
            summary,
            fix,
        });
    }

    pub fn ok(&mut self, id: &'static str, summary: impl Into<String>) {
        self.push(id, Severity::Ok, summary.into(), None);
    }

    pub fn info(&mut self, id: &'static str, summary: impl Into<String>) {
        self.push(id, Severity::Info, summary.into(), None);
    }

    pub fn warn(&mut self, id: &'static str, summary: impl Into<String>, fix: impl Into<String>) {
        self.push(id, Severity::Warning, summary.into(), Some(fix.into()));
    }

    pub fn error(&mut self, id: &'static str, summary: impl Into<String>, fix: impl Into<String>) {
        self.push(id, Severity::Error, summary.into(), Some(fix.into()));
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub version: String,
    pub healthy: bool,
    pub errors: usize,
    pub warnings: usize,
    /// Every warning and error, in section order (the list to act on).
    pub problems: Vec<Problem>,
    pub sections: Vec<Section>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    pub section: &'static str,
    pub id: &'static str,
    pub severity: Severity,
    pub summary: String,
    pub fix: Option<String>,
}

impl Report {
    pub fn new(sections: Vec<Section>) -> Self {
        let problems: Vec<Problem> = sections
            .iter()
            .flat_map(|s| {
                s.findings
                    .iter()
                    .filter(|f| f.severity >= Severity::Warning)
                    .map(move |f| Problem {
                        section: s.name,
                        id: f.id,
                        severity: f.severity,
                        summary: f.summary.clone(),
                        fix: f.fix.clone(),
                    })
            })
            .collect();
        let errors = problems
            .iter()
            .filter(|p| p.severity == Severity::Error)
            .count();
        let warnings = problems.len() - errors;
        Report {
            version: env!("CARGO_PKG_VERSION").to_string(),
            healthy: errors == 0,
            errors,
            warnings,
            problems,
            sections,
        }
    }

    /// 0 when nothing is broken (warnings alone do not fail), 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        if self.healthy {
            0
        } else {
            1
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("report serialises")
    }

    /// The human form: one block per section, one line per finding, the
    /// fix indented under it, and a verdict at the end.
    pub fn to_text(&self) -> String {
        let mut out = format!("flowlane diag {}\n", self.version);
        for s in &self.sections {
            out.push_str(&format!("\n{}\n", s.title));
            for f in &s.findings {
                let mut lines = f.summary.lines();
                out.push_str(&format!(
                    "  {:<5} {}\n",
                    f.severity.label(),
                    lines.next().unwrap_or_default()
                ));
                for more in lines {
                    out.push_str(&format!("        {more}\n"));
                }
                if let Some(fix) = &f.fix {
                    out.push_str(&format!("        -> {fix}\n"));
                }
            }
        }
        let verdict = if !self.healthy {
            "BROKEN"
        } else if self.warnings > 0 {
            "working, with warnings"
        } else {
            "healthy"
        };
        out.push_str(&format!(
            "\n{} error(s), {} warning(s): this node is {verdict}\n",
            self.errors, self.warnings
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(name: &'static str, f: impl FnOnce(&mut Section)) -> Section {
        let mut s = Section::new(name, format!("Title of {name}"));
        f(&mut s);
        s
    }

    #[test]
    fn warnings_alone_keep_exit_code_zero_errors_do_not() {
        let ok = Report::new(vec![section("a", |s| {
            s.ok("a.fine", "fine");
            s.info("a.note", "note");
            s.warn("a.degraded", "degraded", "do this");
        })]);
        assert!(ok.healthy);
        assert_eq!((ok.errors, ok.warnings, ok.exit_code()), (0, 1, 0));
        assert_eq!(ok.problems.len(), 1);
        assert!(ok
            .to_text()
            .ends_with("0 error(s), 1 warning(s): this node is working, with warnings\n"));

        let broken = Report::new(vec![
            section("a", |s| s.warn("a.degraded", "degraded", "do this")),
            section("b", |s| s.error("b.broken", "broken", "fix that")),
        ]);
        assert!(!broken.healthy);
        assert_eq!(broken.exit_code(), 1);
        let ids: Vec<(&str, &str)> = broken.problems.iter().map(|p| (p.section, p.id)).collect();
        assert_eq!(
            ids,
            vec![("a", "a.degraded"), ("b", "b.broken")],
            "section order"
        );
        let json: serde_json::Value = serde_json::from_str(&broken.to_json()).unwrap();
        assert_eq!(json["problems"][1]["severity"], "error");
        assert_eq!(json["problems"][1]["fix"], "fix that");
        assert_eq!(json["healthy"], false);
    }

    #[test]
    fn text_form_puts_fixes_and_continuation_lines_under_their_finding() {
        let r = Report::new(vec![section("x", |s| {
            s.error("x.e", "first line\nsecond line", "the fix");
        })]);
        let text = r.to_text();
        assert!(
            text.contains(
                "Title of x\n  ERROR first line\n        second line\n        -> the fix\n"
            ),
            "{text}"
        );
    }
}
