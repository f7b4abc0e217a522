//! IPAM delegation: `"ipam": {"type": "host-local"}` runs Debian's reference
//! host-local from CNI_PATH exactly as the spec says, including when the
//! runtime asks for a version host-local does not speak (1.1.0).

use serde_json::json;

use flowlane_e2e::binaries::REFERENCE_CNI_DIR;
use flowlane_e2e::cni::{Pod, TestNet};
use flowlane_e2e::result::expect_valid;

fn delegating(net: &TestNet, version: &str) -> serde_json::Value {
    let mut c = net.conf(version);
    c["ipam"]["type"] = json!("host-local");
    c
}

#[test]
fn host_local_serves_every_version_including_1_1() {
    let _turn = crate::turn::take(module_path!());
    let net = TestNet::new("hl", &["10.201.50.0/24", "fd00:201:50::/64"]);
    let mut versions = vec!["0.3.1", "0.4.0", "1.0.0"];
    if net.plugin == flowlane_e2e::binaries::PluginUnderTest::Flowlane {
        versions.push("1.1.0");
    }
    for v in versions {
        let pod = Pod::new("hl");
        let conf = delegating(&net, v);
        let raw = net.pod_call("ADD", &pod, &conf).run().expect_json();
        let res = expect_valid(v, &raw);
        assert_eq!(res.ips.len(), 2, "{v}: {raw:#}");
        // host-local's own lease files, under the network name.
        let lease_dir = net.data_dir().join(&net.name);
        for ip in &res.ips {
            let lease = lease_dir.join(ip.address.to_string());
            let owner = std::fs::read_to_string(&lease)
                .unwrap_or_else(|e| panic!("{v}: host-local lease {}: {e}", lease.display()));
            assert!(owner.starts_with(&pod.id), "{v}: lease owned by {owner:?}");
        }
        let link = pod.netns.link("eth0").expect("eth0");
        for ip in &res.ips {
            assert!(
                link.cidrs().contains(&ip.cidr()),
                "{v}: {} missing",
                ip.cidr()
            );
        }
        if v != "0.3.1" {
            let mut chk = conf.clone();
            chk["prevResult"] = raw.clone();
            net.pod_call("CHECK", &pod, &chk).run().expect_ok();
        }
        let mut del = conf.clone();
        del["prevResult"] = raw;
        net.pod_call("DEL", &pod, &del).run().expect_ok();
        net.pod_call("DEL", &pod, &conf).netns("").run().expect_ok();
        net.assert_clean(&[&pod.id]);
    }
}

#[test]
fn delegated_lease_is_released_when_a_later_add_step_fails() {
    let _turn = crate::turn::take(module_path!());
    let net = TestNet::new("hlf", &["10.201.51.0/24"]);
    let pod = Pod::new("hlf");
    // The pod already has eth0: the plugin fails after IPAM ran and must
    // then run IPAM DEL (spec: "IPAM DEL when a later ADD step fails").
    pod.netns
        .ip(&[
            "link", "add", "eth0", "type", "veth", "peer", "name", "keep0",
        ])
        .expect_ok("pre-existing eth0");
    let out = net.pod_call("ADD", &pod, &delegating(&net, "1.0.0")).run();
    out.error();
    assert!(
        pod.netns.link("keep0").is_some(),
        "the pod's own links survive"
    );
    net.assert_clean(&[&pod.id]);
}

#[test]
fn host_local_found_only_through_cni_path() {
    let _turn = crate::turn::take(module_path!());
    let net = TestNet::new("hlp", &["10.201.52.0/24"]);
    let pod = Pod::new("hlp");
    let own_dir = net.plugin.binary().parent().unwrap().display().to_string();
    // CNI_PATH with several entries, host-local in the last one.
    let path = format!("/nonexistent-flt:{own_dir}:{REFERENCE_CNI_DIR}");
    let conf = delegating(&net, "1.0.0");
    let raw = net
        .pod_call("ADD", &pod, &conf)
        .cni_path(&path)
        .run()
        .expect_json();
    expect_valid("1.0.0", &raw);
    let mut del = conf.clone();
    del["prevResult"] = raw;
    net.pod_call("DEL", &pod, &del)
        .cni_path(&path)
        .run()
        .expect_ok();
    net.assert_clean(&[&pod.id]);
}

#[test]
fn status_with_a_pre_1_1_ipam_plugin_reports_ready() {
    let _turn = crate::turn::take(module_path!());
    // host-local speaks at most 1.0.0 and has no STATUS: the spec (and
    // libcni) treat a plugin without STATUS as available, so flowlane must
    // not report the network unavailable because of it.
    if net_plugin() != flowlane_e2e::binaries::PluginUnderTest::Flowlane {
        return;
    }
    let net = TestNet::new("hls", &["10.201.53.0/24"]);
    let conf = delegating(&net, "1.1.0");
    // Repeated: host-local answers VERSION without reading its stdin, so a
    // delegating plugin that treats the resulting EPIPE as a failure fails
    // only when the scheduler lets host-local exit first (seen under load).
    for _ in 0..40 {
        net.invoke("STATUS").config(&conf).run().expect_ok();
    }
    // And the delegated network keeps working after STATUS.
    let pod = Pod::new("hls");
    let raw = net.pod_call("ADD", &pod, &conf).run().expect_json();
    let mut del = conf.clone();
    del["prevResult"] = raw;
    net.pod_call("DEL", &pod, &del).run().expect_ok();
    net.assert_clean(&[&pod.id]);
}

fn net_plugin() -> flowlane_e2e::binaries::PluginUnderTest {
    flowlane_e2e::binaries::PluginUnderTest::from_env()
}

#[test]
fn gc_with_a_delegated_pre_1_1_ipam_cleans_the_registry() {
    let _turn = crate::turn::take(module_path!());
    // host-local has no GC: flowlane's GC must still succeed and drop the
    // stale pod-registry entries (the leases are host-local's business).
    if net_plugin() != flowlane_e2e::binaries::PluginUnderTest::Flowlane {
        return;
    }
    let net = TestNet::new("hlgc", &["10.201.54.0/24"]);
    let conf = delegating(&net, "1.1.0");
    let pods: Vec<Pod> = (0..2).map(|_| Pod::new("hlgc")).collect();
    let results: Vec<serde_json::Value> = pods
        .iter()
        .map(|p| net.pod_call("ADD", p, &conf).run().expect_json())
        .collect();
    assert_eq!(net.registry_entries().len(), 2);
    let mut gc = conf.clone();
    gc["cni.dev/valid-attachments"] = json!([{"containerID": pods[0].id, "ifname": "eth0"}]);
    net.invoke("GC").config(&gc).run().expect_ok();
    let left: Vec<String> = net
        .registry_entries()
        .into_iter()
        .map(|e| e.container_id)
        .collect();
    assert_eq!(left, vec![pods[0].id.clone()]);
    for (p, r) in pods.iter().zip(results) {
        let mut del = conf.clone();
        del["prevResult"] = r;
        net.pod_call("DEL", p, &del).run().expect_ok();
    }
    let ids: Vec<&str> = pods.iter().map(|p| p.id.as_str()).collect();
    net.assert_clean(&ids);
}
