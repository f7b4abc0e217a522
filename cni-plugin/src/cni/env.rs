//! The runtime's environment variables (SPEC.md, "Parameters"), validated
//! as libcni's skel does: container ids and interface names with the same
//! character rules, missing required variables reported by name (code 4).

use super::error::{CniError, CniResult};

/// The operation named by `CNI_COMMAND`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Status,
    Gc,
    Version,
}

impl Command {
    pub fn parse(s: &str) -> CniResult<Command> {
        Ok(match s {
            "ADD" => Command::Add,
            "DEL" => Command::Del,
            "CHECK" => Command::Check,
            "STATUS" => Command::Status,
            "GC" => Command::Gc,
            "VERSION" => Command::Version,
            other => {
                return Err(CniError::env(format!("unknown CNI_COMMAND: {other:?}"))
                    .with_details("CNI_COMMAND must be ADD, DEL, CHECK, STATUS, GC or VERSION"))
            }
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
            Command::Status => "STATUS",
            Command::Gc => "GC",
            Command::Version => "VERSION",
        }
    }
}

/// Everything the runtime passed through the environment.
#[derive(Debug, Clone, Default)]
pub struct CniEnv {
    pub container_id: String,
    pub netns: String,
    pub ifname: String,
    pub args: CniArgs,
    /// `CNI_PATH` split on ':'; empty entries dropped.
    pub path: Vec<String>,
}

/// Reads and validates the environment for `cmd` from `get` (a lookup
/// function so tests need not touch the process environment).
pub fn from_lookup(cmd: Command, get: impl Fn(&str) -> Option<String>) -> CniResult<CniEnv> {
    let var = |name: &str| get(name).unwrap_or_default();
    // As libcni's skel: CNI_PATH is required by every command but VERSION
    // (SPEC.md section 3: the runtime "must" provide it to plugins).
    let (need_id, need_netns, need_ifname, need_path) = match cmd {
        Command::Add | Command::Check => (true, true, true, true),
        Command::Del => (true, false, true, true),
        Command::Gc | Command::Status => (false, false, false, true),
        Command::Version => (false, false, false, false),
    };
    let env = CniEnv {
        container_id: var("CNI_CONTAINERID"),
        netns: var("CNI_NETNS"),
        ifname: var("CNI_IFNAME"),
        args: CniArgs::parse(&var("CNI_ARGS"))?,
        path: var("CNI_PATH")
            .split(':')
            .filter(|p| !p.is_empty())
            .map(str::to_string)
            .collect(),
    };
    let mut missing = Vec::new();
    if need_id && env.container_id.is_empty() {
        missing.push("CNI_CONTAINERID");
    }
    if need_netns && env.netns.is_empty() {
        missing.push("CNI_NETNS");
    }
    if need_ifname && env.ifname.is_empty() {
        missing.push("CNI_IFNAME");
    }
    if need_path && env.path.is_empty() {
        missing.push("CNI_PATH");
    }
    if !missing.is_empty() {
        return Err(CniError::env(format!(
            "required env variables [{}] missing",
            missing.join(",")
        )));
    }
    if need_id {
        validate_container_id(&env.container_id)?;
    }
    if need_ifname {
        validate_ifname(&env.ifname)?;
    }
    Ok(env)
}

/// Spec: "Must start with an alphanumeric character, optionally followed by
/// any combination of one or more alphanumeric characters, underscore, dot
/// or hyphen". Network names follow the same rule.
pub fn is_valid_name(s: &str) -> bool {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) if c.is_ascii_alphanumeric() => {}
        _ => return false,
    }
    chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

fn validate_container_id(id: &str) -> CniResult<()> {
    if is_valid_name(id) {
        Ok(())
    } else {
        Err(CniError::env("invalid characters in CNI_CONTAINERID").with_details(id))
    }
}

/// Linux interface name rules (as libcni's `ValidateInterfaceName`).
pub fn validate_ifname(name: &str) -> CniResult<()> {
    let bad = |why: &str| Err(CniError::env(format!("invalid CNI_IFNAME {name:?}: {why}")));
    if name.len() > 15 {
        return bad("longer than 15 bytes");
    }
    if name == "." || name == ".." {
        return bad("is . or ..");
    }
    if name
        .chars()
        .any(|c| c == '/' || c == ':' || c.is_whitespace() || c == '\0')
    {
        return bad("contains '/', ':' or whitespace");
    }
    Ok(())
}

/// `CNI_ARGS`: "K=V;K=V". Unknown keys are kept (and ignored by callers),
/// as with `IgnoreUnknown=1`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniArgs {
    pub pairs: Vec<(String, String)>,
}

impl CniArgs {
    pub fn parse(s: &str) -> CniResult<CniArgs> {
        let mut pairs = Vec::new();
        for item in s.split(';').filter(|i| !i.is_empty()) {
            let (k, v) = item.split_once('=').ok_or_else(|| {
                CniError::env(format!("invalid CNI_ARGS pair {item:?}"))
                    .with_details("CNI_ARGS must be KEY=VALUE pairs separated by ';'")
            })?;
            pairs.push((k.to_string(), v.to_string()));
        }
        Ok(CniArgs { pairs })
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .filter(|v| !v.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn cni_args_parsing() {
        let a = CniArgs::parse(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u-1",
        )
        .unwrap();
        assert_eq!(a.get("K8S_POD_NAMESPACE"), Some("ns"));
        assert_eq!(a.get("K8S_POD_NAME"), Some("web-0"));
        assert_eq!(a.get("K8S_POD_UID"), Some("u-1"));
        assert_eq!(a.get("MISSING"), None);
        assert_eq!(CniArgs::parse("").unwrap().pairs.len(), 0);
        assert_eq!(CniArgs::parse("A=1;;B=2;").unwrap().pairs.len(), 2);
        assert_eq!(CniArgs::parse("A=b=c").unwrap().get("A"), Some("b=c"));
        assert_eq!(CniArgs::parse("novalue").unwrap_err().code, 4);
    }

    #[test]
    fn commands() {
        assert_eq!(Command::parse("GC").unwrap(), Command::Gc);
        assert_eq!(Command::parse("add").unwrap_err().code, 4);
        assert_eq!(Command::parse("").unwrap_err().code, 4);
    }

    #[test]
    fn required_variables_per_command() {
        let full = [
            ("CNI_CONTAINERID", "c1"),
            ("CNI_NETNS", "/run/netns/x"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin"),
        ];
        assert!(from_lookup(Command::Add, lookup(&full)).is_ok());
        let e = from_lookup(Command::Add, lookup(&full[..3])).unwrap_err();
        assert!(e.msg.contains("CNI_PATH"));
        let e = from_lookup(Command::Add, lookup(&full[1..])).unwrap_err();
        assert_eq!(e.code, 4);
        assert!(e.msg.contains("CNI_CONTAINERID"));
        let e = from_lookup(Command::Add, lookup(&[full[0], full[2], full[3]])).unwrap_err();
        assert!(e.msg.contains("CNI_NETNS"));
        let e = from_lookup(Command::Check, lookup(&[full[0], full[1], full[3]])).unwrap_err();
        assert!(e.msg.contains("CNI_IFNAME"));
        // DEL does not need the netns.
        assert!(from_lookup(Command::Del, lookup(&[full[0], full[2], full[3]])).is_ok());
        // GC and STATUS need only CNI_PATH; VERSION nothing.
        assert!(from_lookup(Command::Gc, lookup(&[])).is_err());
        assert!(from_lookup(Command::Status, lookup(&[])).is_err());
        assert_eq!(
            from_lookup(Command::Gc, lookup(&[("CNI_PATH", "/a::/b")]))
                .unwrap()
                .path,
            ["/a", "/b"]
        );
        assert!(from_lookup(Command::Version, lookup(&[])).is_ok());
    }

    #[test]
    fn id_and_ifname_validation() {
        let with = |id: &str, ifn: &str| {
            from_lookup(
                Command::Add,
                lookup(&[
                    ("CNI_CONTAINERID", id),
                    ("CNI_NETNS", "/x"),
                    ("CNI_IFNAME", ifn),
                    ("CNI_PATH", "/p"),
                ]),
            )
        };
        assert_eq!(with("-bad", "eth0").unwrap_err().code, 4);
        assert_eq!(with("a/b", "eth0").unwrap_err().code, 4);
        assert!(with("a_b.c-D9", "eth0").is_ok());
        assert_eq!(with("c", "sixteen-chars-xx").unwrap_err().code, 4);
        assert_eq!(with("c", "a b").unwrap_err().code, 4);
        assert_eq!(with("c", "a:b").unwrap_err().code, 4);
        assert_eq!(with("c", "..").unwrap_err().code, 4);
        assert!(with("c", "net1").is_ok());
    }
}
