//! Runtimes create and delete pods in parallel: 64 concurrent ADDs on one
//! network must get 64 distinct addresses, and 64 concurrent DELs must leave
//! no lease, host veth or registry entry behind.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use flowlane_e2e::binaries::PluginUnderTest;
use flowlane_e2e::cni::{Pod, TestNet};
use flowlane_e2e::result::expect_valid;

const PODS: usize = 64;

#[test]
fn sixty_four_concurrent_adds_then_dels_leak_nothing() {
    let v = match PluginUnderTest::from_env() {
        PluginUnderTest::Flowlane => "1.1.0",
        PluginUnderTest::Reference => "1.0.0",
    };
    let net = Arc::new(TestNet::new("par", &["10.201.40.0/24", "fd00:201:40::/64"]));
    let pods: Vec<Arc<Pod>> = (0..PODS).map(|_| Arc::new(Pod::new("par"))).collect();

    let adds: Vec<_> = pods
        .iter()
        .map(|p| {
            let (net, p) = (net.clone(), p.clone());
            std::thread::spawn(move || net.pod_call("ADD", &p, &net.conf(v)).run())
        })
        .collect();
    let results: Vec<_> = adds
        .into_iter()
        .map(|h| h.join().expect("ADD thread"))
        .collect();
    let results: Vec<_> = results.iter().map(|o| o.expect_json()).collect();

    let mut v4 = BTreeSet::<IpAddr>::new();
    let mut v6 = BTreeSet::<IpAddr>::new();
    for (pod, raw) in pods.iter().zip(&results) {
        let r = expect_valid(v, raw);
        v4.insert(r.ipv4().expect("v4").address);
        v6.insert(r.ipv6().expect("v6").address);
        let link = pod.netns.link("eth0").expect("eth0 in pod");
        for ip in &r.ips {
            assert!(
                link.cidrs().contains(&ip.cidr()),
                "{} not on {}",
                ip.cidr(),
                pod.netns.name()
            );
        }
    }
    assert_eq!(v4.len(), PODS, "distinct IPv4 addresses");
    assert_eq!(v6.len(), PODS, "distinct IPv6 addresses");
    assert_eq!(flowlane_e2e::host::bridge_ports(&net.name).len(), PODS);
    assert_eq!(net.leases().len(), 2 * PODS, "one lease per address");
    if net.plugin == PluginUnderTest::Flowlane {
        assert_eq!(net.registry_entries().len(), PODS);
    }

    let dels: Vec<_> = pods
        .iter()
        .zip(results)
        .map(|(p, r)| {
            let (net, p) = (net.clone(), p.clone());
            std::thread::spawn(move || net.del(&p, v, Some(&r)))
        })
        .collect();
    for h in dels {
        h.join().expect("DEL thread").expect_ok();
    }
    for p in &pods {
        assert!(
            p.netns.link("eth0").is_none(),
            "eth0 left in {}",
            p.netns.name()
        );
    }
    let ids: Vec<&str> = pods.iter().map(|p| p.id.as_str()).collect();
    net.assert_clean(&ids);
}
