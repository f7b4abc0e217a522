//! VERSION, STATUS and GC (CNI 1.1.0), driven as libcni drives them.

use serde_json::{json, Value};

use flowlane_e2e::binaries::PluginUnderTest;
use flowlane_e2e::cni::{code, Pod, TestNet, VERSIONS};

fn flowlane_only() -> bool {
    // Debian's reference plugins speak at most 1.0.0: no STATUS, no GC.
    PluginUnderTest::from_env() == PluginUnderTest::Flowlane
}

#[test]
fn version_lists_every_supported_spec_version() {
    let _turn = crate::turn::take(module_path!());
    let plugin = PluginUnderTest::from_env();
    for asked in ["1.1.0", "1.0.0", "0.4.0", "0.3.1"] {
        let out = flowlane_e2e::cni::Invocation::new(plugin.binary(), "VERSION")
            .config(&json!({"cniVersion": asked}))
            .run();
        let v = out.expect_json();
        let supported: Vec<&str> = v["supportedVersions"]
            .as_array()
            .expect("supportedVersions list")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let want: &[&str] = if plugin == PluginUnderTest::Flowlane {
            &VERSIONS
        } else {
            &VERSIONS[..4]
        };
        for w in want {
            assert!(supported.contains(w), "{w} missing from {supported:?}");
        }
        assert!(v["cniVersion"].is_string(), "{v}");
    }
    // libcni may call VERSION with only {"cniVersion"} or nothing useful on stdin.
    let out = flowlane_e2e::cni::Invocation::new(plugin.binary(), "VERSION")
        .stdin(&b"{}"[..])
        .run();
    out.expect_json();
}

#[test]
fn status_reports_ready_unwritable_state_and_exhaustion() {
    let _turn = crate::turn::take(module_path!());
    if !flowlane_only() {
        return;
    }
    let net = TestNet::new("stat", &["10.201.30.0/24"]);
    let status = |conf: &Value| net.invoke("STATUS").config(conf).run();
    let mut conf = net.conf("1.1.0");
    conf["ipam"]["ranges"] = json!([[{"subnet": "10.201.30.0/24", "rangeStart": "10.201.30.10", "rangeEnd": "10.201.30.11"}]]);
    status(&conf).expect_ok();

    // State directory that cannot be written.
    let file = net.dir.join("plainfile");
    std::fs::write(&file, b"x").unwrap();
    let mut broken = conf.clone();
    broken["stateDir"] = json!(file.join("state").display().to_string());
    status(&broken).expect_error(code::NOT_AVAILABLE);

    // Range exhausted: not available until an address is released.
    let a = Pod::new("sta");
    let b = Pod::new("stb");
    let ra = net.pod_call("ADD", &a, &conf).run().expect_json();
    status(&conf).expect_ok();
    let rb = net.pod_call("ADD", &b, &conf).run().expect_json();
    status(&conf).expect_error(code::NOT_AVAILABLE);
    for (p, r) in [(&a, ra), (&b, rb)] {
        let mut d = conf.clone();
        d["prevResult"] = r;
        net.pod_call("DEL", p, &d).run().expect_ok();
    }
    status(&conf).expect_ok();

    // STATUS does not exist before 1.1.0.
    let mut old = conf.clone();
    old["cniVersion"] = json!("1.0.0");
    status(&old).expect_error(code::INCOMPATIBLE_VERSION);
    net.assert_clean(&[&a.id, &b.id]);
}

/// Runs GC keeping `keep` and checks that exactly the others lost their
/// lease and registry entry.
fn gc_keeps_only_valid_attachments(key: &str, subnet: &str, tag: &str) {
    let net = TestNet::new(tag, &[subnet]);
    let pods: Vec<Pod> = (0..4).map(|_| Pod::new(tag)).collect();
    let results: Vec<Value> = pods.iter().map(|p| net.add(p, "1.1.0")).collect();
    assert_eq!(net.leases().len(), 4);
    assert_eq!(net.registry_entries().len(), 4);
    let keep = [&pods[0], &pods[2]];
    let mut conf = net.conf("1.1.0");
    conf[key] = json!(keep
        .iter()
        .map(|p| json!({"containerID": p.id, "ifname": p.ifname}))
        .collect::<Vec<_>>());
    net.invoke("GC").config(&conf).run().expect_ok();

    let mut kept_ids: Vec<String> = net
        .registry_entries()
        .into_iter()
        .map(|e| e.container_id)
        .collect();
    kept_ids.sort();
    let mut want: Vec<String> = keep.iter().map(|p| p.id.clone()).collect();
    want.sort();
    assert_eq!(kept_ids, want, "{key}: registry after GC");
    let leases = net.leases();
    assert_eq!(leases.len(), 2, "{key}: leases after GC: {leases:?}");
    for p in keep {
        let owned = flowlane_e2e::fsutil::files_mentioning(&net.data_dir(), &p.id);
        assert_eq!(owned.len(), 1, "{key}: lease of kept {} survives", p.id);
    }
    for p in [&pods[1], &pods[3]] {
        let owned = flowlane_e2e::fsutil::files_mentioning(&net.data_dir(), &p.id);
        assert!(owned.is_empty(), "{key}: stale lease of {} released", p.id);
    }
    // A second GC changes nothing; kept pods still pass CHECK.
    net.invoke("GC").config(&conf).run().expect_ok();
    assert_eq!(net.leases().len(), 2);
    net.check(&pods[0], "1.1.0", &results[0]).expect_ok();
    // Every DEL (including of the collected ones) still succeeds.
    for (p, r) in pods.iter().zip(&results) {
        net.del(p, "1.1.0", Some(r)).expect_ok();
    }
    let ids: Vec<&str> = pods.iter().map(|p| p.id.as_str()).collect();
    net.assert_clean(&ids);
}

#[test]
fn gc_releases_only_stale_attachments() {
    let _turn = crate::turn::take(module_path!());
    if !flowlane_only() {
        return;
    }
    gc_keeps_only_valid_attachments("cni.dev/valid-attachments", "10.201.31.0/24", "gcv");
}

#[test]
fn gc_accepts_the_older_attachments_key() {
    let _turn = crate::turn::take(module_path!());
    if !flowlane_only() {
        return;
    }
    gc_keeps_only_valid_attachments("cni.dev/attachments", "10.201.32.0/24", "gca");
}

#[test]
fn gc_with_an_empty_valid_list_releases_everything_and_needs_1_1() {
    let _turn = crate::turn::take(module_path!());
    if !flowlane_only() {
        return;
    }
    let net = TestNet::new("gce", &["10.201.33.0/24"]);
    let a = Pod::new("gce");
    let r = net.add(&a, "1.1.0");
    let mut old = net.conf("1.0.0");
    old["cni.dev/valid-attachments"] = json!([]);
    net.invoke("GC")
        .config(&old)
        .run()
        .expect_error(code::INCOMPATIBLE_VERSION);
    assert_eq!(net.leases().len(), 1, "a rejected GC releases nothing");
    let mut conf = net.conf("1.1.0");
    conf["cni.dev/valid-attachments"] = json!([]);
    net.invoke("GC").config(&conf).run().expect_ok();
    assert!(net.leases().is_empty());
    assert!(net.registry_entries().is_empty());
    net.del(&a, "1.1.0", Some(&r)).expect_ok();
    net.assert_clean(&[&a.id]);
}
