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

/// One 64-pod storm at a time: two at once would only measure the machine.
static HEAVY: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn sixty_four_concurrent_adds_then_dels_leak_nothing() {
    let _turn = crate::turn::take(module_path!());
    storm("par", "10.201.40.0/24", "fd00:201:40::/64", None);
}

#[test]
fn sixty_four_concurrent_adds_through_delegated_host_local() {
    let _turn = crate::turn::take(module_path!());
    storm(
        "parhl",
        "10.201.41.0/24",
        "fd00:201:41::/64",
        Some("host-local"),
    );
}

fn storm(tag: &str, v4: &str, v6: &str, ipam_type: Option<&str>) {
    let _heavy = HEAVY.lock().unwrap_or_else(|e| e.into_inner());
    let v = match PluginUnderTest::from_env() {
        PluginUnderTest::Flowlane => "1.1.0",
        PluginUnderTest::Reference => "1.0.0",
    };
    let net = Arc::new(TestNet::new(tag, &[v4, v6]));
    let mut conf = net.conf(v);
    if let Some(t) = ipam_type {
        conf["ipam"]["type"] = serde_json::json!(t);
    }
    let conf = Arc::new(conf);
    let pods: Vec<Arc<Pod>> = (0..PODS).map(|_| Arc::new(Pod::new(tag))).collect();

    let adds: Vec<_> = pods
        .iter()
        .map(|p| {
            let (net, p, conf) = (net.clone(), p.clone(), conf.clone());
            std::thread::spawn(move || net.pod_call("ADD", &p, &conf).run())
        })
        .collect();
    let results: Vec<_> = adds
        .into_iter()
        .map(|h| h.join().expect("ADD thread"))
        .collect();
    let failed: Vec<String> = results
        .iter()
        .filter(|o| !o.success())
        .map(|o| o.stdout.trim().to_string())
        .collect();
    if !failed.is_empty() {
        // A failed ADD must leave nothing: DEL everything, check, then report.
        for (p, o) in pods.iter().zip(&results) {
            if !o.success() {
                let links: Vec<String> = p.netns.links().into_iter().map(|l| l.ifname).collect();
                assert_eq!(
                    links,
                    vec!["lo"],
                    "failed ADD left links in {}",
                    p.netns.name()
                );
            }
            let _ = net.pod_call("DEL", p, &conf).run();
        }
        let ids: Vec<&str> = pods.iter().map(|p| p.id.as_str()).collect();
        net.assert_clean(&ids);
        panic!(
            "{} of {PODS} concurrent ADDs failed, e.g. {}",
            failed.len(),
            failed[0]
        );
    }
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
            let mut del = (*conf).clone();
            del["prevResult"] = r;
            std::thread::spawn(move || net.pod_call("DEL", &p, &del).run())
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
