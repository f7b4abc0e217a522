//! Deterministic host-side names, so DEL finds an attachment's veth without
//! entering its (possibly gone) netns.

/// FNV-1a: stable across builds and platforms, no dependency.
pub fn fnv1a64(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for b in p.bytes().chain(std::iter::once(0u8)) {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    h
}

/// "veth" + 11 hex digits (15 bytes, the kernel's limit) of the hash of
/// (container id, ifname).
pub fn host_veth(container_id: &str, ifname: &str) -> String {
    let h = fnv1a64(&[container_id, ifname]);
    format!("veth{:011x}", h & 0xfff_ffff_ffff)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_veth_names_are_stable_short_and_distinct() {
        let a = host_veth("c1", "eth0");
        assert_eq!(a, host_veth("c1", "eth0"));
        assert_eq!(a.len(), 15);
        assert!(a.starts_with("veth"));
        assert_ne!(a, host_veth("c1", "eth1"));
        assert_ne!(a, host_veth("c2", "eth0"));
        // The separator matters: ("ab","c") and ("a","bc") differ.
        assert_ne!(host_veth("ab", "c"), host_veth("a", "bc"));
    }
}
