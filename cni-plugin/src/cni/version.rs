//! CNI specification versions this plugin speaks, and their ordering.

use super::error::{code, CniError, CniResult};

/// Versions answered by VERSION, oldest first.
pub const SUPPORTED: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// The newest version we implement.
pub const CURRENT: &str = "1.1.0";

/// A parsed `major.minor.patch` version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub u32, pub u32, pub u32);

impl Version {
    pub const V0_4_0: Version = Version(0, 4, 0);
    pub const V1_0_0: Version = Version(1, 0, 0);
    pub const V1_1_0: Version = Version(1, 1, 0);

    /// Parses "1.0.0" (also "1.0", "1"), as libcni's semver parsing does.
    pub fn parse(s: &str) -> Option<Version> {
        let mut parts = s.trim().split('.');
        let mut next = || -> Option<u32> {
            match parts.next() {
                None => Some(0),
                Some(p) => p.parse().ok(),
            }
        };
        let v = Version(next()?, next()?, next()?);
        if parts.next().is_some() {
            return None;
        }
        Some(v)
    }

    /// True for the result formats with `"version"` in each IP (0.3.x, 0.4.0).
    pub fn is_0_x(self) -> bool {
        self.0 == 0
    }
}

/// Checks that a config's `cniVersion` is one we support (error 1 if not,
/// 6 if it is not a version at all).
pub fn check_supported(v: &str) -> CniResult<Version> {
    let parsed = Version::parse(v)
        .ok_or_else(|| CniError::new(code::DECODE, format!("invalid cniVersion {v:?}")))?;
    if SUPPORTED.iter().any(|s| Version::parse(s) == Some(parsed)) {
        Ok(parsed)
    } else {
        Err(
            CniError::new(code::INCOMPATIBLE_VERSION, "incompatible CNI versions").with_details(
                format!("config is {v:?}, plugin supports {}", SUPPORTED.join(", ")),
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_order() {
        assert_eq!(Version::parse("1.1.0"), Some(Version(1, 1, 0)));
        assert_eq!(Version::parse("0.4"), Some(Version(0, 4, 0)));
        assert_eq!(Version::parse("x"), None);
        assert!(Version::parse("0.4.0").unwrap() < Version::V1_0_0);
    }

    #[test]
    fn supported_versions_only() {
        for v in SUPPORTED {
            assert!(check_supported(v).is_ok());
        }
        assert_eq!(check_supported("0.2.0").unwrap_err().code, 1);
        assert_eq!(check_supported("2.0.0").unwrap_err().code, 1);
        assert_eq!(check_supported("banana").unwrap_err().code, 6);
    }
}
