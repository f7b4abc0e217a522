//! Bad configurations and bad environments: every one must produce the
//! spec's error JSON (exactly one document on stdout) with the right code, a
//! non-zero exit, and leak nothing (no lease, no host veth, no registry
//! entry, no link in the pod).

use serde_json::{json, Value};

use flowlane_e2e::cni::{code, Invocation, PluginOutput, Pod, TestNet};
use flowlane_e2e::netns::Netns;

const V: &str = "1.0.0";

/// Asserts `out` is a well-formed error with one of `codes`, and that the pod
/// and the network kept nothing of the attempt.
fn assert_rejected(label: &str, out: &PluginOutput, codes: &[u64], net: &TestNet, pod: &Pod) {
    assert!(
        !out.success(),
        "{label}: expected failure, got success: {}",
        out.stdout
    );
    let e = out.error();
    assert!(
        codes.contains(&e.code),
        "{label}: code {} not in {codes:?}: {} ({:?})\nstderr: {}",
        e.code,
        e.msg,
        e.details,
        out.stderr
    );
    let links: Vec<String> = pod.netns.links().into_iter().map(|l| l.ifname).collect();
    assert_eq!(
        links,
        vec!["lo".to_string()],
        "{label}: pod netns not left untouched"
    );
    net.assert_clean(&[&pod.id]);
}

/// A mutation of the valid configuration.
fn with(net: &TestNet, f: impl FnOnce(&mut Value)) -> Value {
    let mut c = net.conf(V);
    f(&mut c);
    c
}

#[test]
fn bad_environment_is_rejected_with_code_4() {
    let _turn = crate::turn::take(module_path!());
    let net = TestNet::new("env", &["10.201.10.0/24"]);
    let pod = Pod::new("env");
    let conf = net.conf(V);
    let base = || net.pod_call("ADD", &pod, &conf);
    let cases: Vec<(&str, Invocation, Vec<u64>)> = vec![
        (
            "unknown command",
            base().env("CNI_COMMAND", "FROB"),
            vec![code::INVALID_ENV],
        ),
        (
            "lower-case command",
            base().env("CNI_COMMAND", "add"),
            vec![code::INVALID_ENV],
        ),
        (
            "empty command",
            base().env("CNI_COMMAND", ""),
            vec![code::INVALID_ENV],
        ),
        (
            "missing CNI_CONTAINERID",
            base().unset("CNI_CONTAINERID"),
            vec![code::INVALID_ENV],
        ),
        (
            "empty CNI_CONTAINERID",
            base().container_id(""),
            vec![code::INVALID_ENV],
        ),
        (
            "container id with a slash",
            base().container_id("bad/id"),
            vec![code::INVALID_ENV],
        ),
        (
            "missing CNI_IFNAME",
            base().unset("CNI_IFNAME"),
            vec![code::INVALID_ENV],
        ),
        (
            "CNI_IFNAME too long",
            base().ifname("eth0123456789012"),
            vec![code::INVALID_ENV],
        ),
        (
            "CNI_IFNAME with a slash",
            base().ifname("et/h0"),
            vec![code::INVALID_ENV],
        ),
        (
            "CNI_IFNAME '.'",
            base().ifname("."),
            vec![code::INVALID_ENV],
        ),
        (
            "CNI_IFNAME with a space",
            base().ifname("eth 0"),
            vec![code::INVALID_ENV],
        ),
        (
            "CNI_IFNAME with a colon",
            base().ifname("eth:0"),
            vec![code::INVALID_ENV],
        ),
        (
            "container id with a space",
            base().container_id("bad id"),
            vec![code::INVALID_ENV],
        ),
        (
            "missing CNI_NETNS",
            base().unset("CNI_NETNS"),
            vec![code::INVALID_ENV],
        ),
        (
            "malformed CNI_ARGS",
            base().args("K8S_POD_NAME"),
            vec![code::INVALID_ENV],
        ),
        (
            "nonexistent netns",
            base().netns("/var/run/netns/flt-no-such-netns"),
            vec![code::UNKNOWN_CONTAINER],
        ),
        (
            "DEL without CNI_CONTAINERID",
            net.pod_call("DEL", &pod, &conf).unset("CNI_CONTAINERID"),
            vec![code::INVALID_ENV],
        ),
        (
            "CHECK without CNI_IFNAME",
            net.pod_call("CHECK", &pod, &conf).unset("CNI_IFNAME"),
            vec![code::INVALID_ENV],
        ),
    ];
    for (label, inv, codes) in cases {
        assert_rejected(label, &inv.run(), &codes, &net, &pod);
    }
}

#[test]
fn malformed_stdin_is_a_decode_error() {
    let _turn = crate::turn::take(module_path!());
    let net = TestNet::new("json", &["10.201.11.0/24"]);
    let pod = Pod::new("json");
    let conf = net.conf(V);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "truncated JSON",
            b"{\"cniVersion\":\"1.0.0\",\"name\":".to_vec(),
        ),
        ("not JSON", b"flowlane please".to_vec()),
        ("empty stdin", Vec::new()),
        ("JSON array", b"[1,2,3]".to_vec()),
        ("two documents", {
            let mut two = serde_json::to_vec(&conf).unwrap();
            two.extend_from_slice(b"{}");
            two
        }),
        ("invalid UTF-8", b"{\"name\":\"\xff\xfe\"}".to_vec()),
    ];
    for (label, stdin) in cases {
        let out = net.pod_call("ADD", &pod, &conf).stdin(stdin).run();
        assert_rejected(label, &out, &[code::DECODE_FAILURE], &net, &pod);
    }
    // DEL, CHECK and STATUS decode their stdin just the same.
    for cmd in ["DEL", "CHECK", "STATUS", "GC"] {
        let out = net
            .pod_call(cmd, &pod, &conf)
            .stdin(&b"flowlane please"[..])
            .run();
        assert_rejected(cmd, &out, &[code::DECODE_FAILURE], &net, &pod);
    }
}

#[test]
fn unsupported_versions_are_rejected_with_code_1() {
    let _turn = crate::turn::take(module_path!());
    let net = TestNet::new("ver", &["10.201.12.0/24"]);
    let pod = Pod::new("verr");
    for bad in ["9.9.9", "0.2.0", "2.0.0"] {
        let out = net
            .pod_call("ADD", &pod, &with(&net, |c| c["cniVersion"] = json!(bad)))
            .run();
        assert_rejected(bad, &out, &[code::INCOMPATIBLE_VERSION], &net, &pod);
    }
    // CHECK did not exist before 0.4.0.
    let out = net
        .pod_call(
            "CHECK",
            &pod,
            &with(&net, |c| c["cniVersion"] = json!("0.3.1")),
        )
        .run();
    assert_rejected(
        "CHECK at 0.3.1",
        &out,
        &[code::INCOMPATIBLE_VERSION],
        &net,
        &pod,
    );
}

#[test]
fn invalid_configuration_values_are_rejected_with_code_7() {
    let _turn = crate::turn::take(module_path!());
    let net = TestNet::new("cfg", &["10.201.13.0/24"]);
    let pod = Pod::new("cfg");
    type Mutation = Box<dyn Fn(&mut Value)>;
    let range = |r: Value| -> Mutation {
        Box::new(move |c: &mut Value| c["ipam"]["ranges"] = json!([[r.clone()]]))
    };
    // Wrong JSON types are a decode failure to some (the reference plugins
    // answer 6) and an invalid config to others: both codes are the spec's.
    const TYPE: &str = "type:";
    let cases: Vec<(&str, Mutation)> = vec![
        (
            "missing name",
            Box::new(|c| drop(c.as_object_mut().unwrap().remove("name"))),
        ),
        (
            "type: name not a string",
            Box::new(|c| c["name"] = json!(42)),
        ),
        (
            "type: cniVersion not a string",
            Box::new(|c| c["cniVersion"] = json!(1.0)),
        ),
        (
            "type: isGateway not a bool",
            Box::new(|c| c["isGateway"] = json!("yes")),
        ),
        (
            "type: mtu not a number",
            Box::new(|c| c["mtu"] = json!("jumbo")),
        ),
        (
            "network name with a slash",
            Box::new(|c| c["name"] = json!("bad/name")),
        ),
        (
            "IPv4 subnet /32 has no address to give",
            range(json!({"subnet": "10.201.13.5/32"})),
        ),
        (
            "IPv6 subnet /128 has no address to give",
            range(json!({"subnet": "fd00:201:13::5/128"})),
        ),
        ("mtu negative", Box::new(|c| c["mtu"] = json!(-1))),
        (
            "bridge name too long",
            Box::new(|c| c["bridge"] = json!("flt-bridge-name-too-long")),
        ),
        (
            "ipam ranges empty",
            Box::new(|c| c["ipam"]["ranges"] = json!([])),
        ),
        (
            "type: ipam ranges not a list",
            Box::new(|c| c["ipam"]["ranges"] = json!("10.201.13.0/24")),
        ),
        (
            "subnet not an address",
            range(json!({"subnet": "10.201.300.0/24"})),
        ),
        (
            "subnet without prefix",
            range(json!({"subnet": "10.201.13.0"})),
        ),
        (
            "subnet prefix too long",
            range(json!({"subnet": "10.201.13.0/33"})),
        ),
        ("type: subnet not a string", range(json!({"subnet": 10}))),
        (
            "rangeStart outside subnet",
            range(json!({"subnet": "10.201.13.0/24", "rangeStart": "10.201.14.5"})),
        ),
        (
            "rangeEnd outside subnet",
            range(json!({"subnet": "10.201.13.0/24", "rangeEnd": "10.201.99.5"})),
        ),
        (
            "rangeEnd before rangeStart",
            range(
                json!({"subnet": "10.201.13.0/24", "rangeStart": "10.201.13.50", "rangeEnd": "10.201.13.10"}),
            ),
        ),
        (
            "gateway outside subnet",
            range(json!({"subnet": "10.201.13.0/24", "gateway": "10.9.9.1"})),
        ),
        (
            "rangeStart not an address",
            range(json!({"subnet": "10.201.13.0/24", "rangeStart": "start"})),
        ),
        (
            "mixed families in one range set",
            Box::new(|c| {
                c["ipam"]["ranges"] =
                    json!([[{"subnet": "10.201.13.0/24"}, {"subnet": "fd00:201:13::/64"}]])
            }),
        ),
        (
            "overlapping range sets",
            Box::new(|c| {
                c["ipam"]["ranges"] =
                    json!([[{"subnet": "10.201.13.0/24"}], [{"subnet": "10.201.13.0/25"}]])
            }),
        ),
        (
            "route dst not a CIDR",
            Box::new(|c| c["ipam"]["routes"] = json!([{"dst": "everywhere"}])),
        ),
        (
            "route gw not an address",
            Box::new(|c| c["ipam"]["routes"] = json!([{"dst": "0.0.0.0/0", "gw": "gw"}])),
        ),
    ];
    for (label, mutate) in cases {
        let out = net.pod_call("ADD", &pod, &with(&net, |c| mutate(c))).run();
        let codes: &[u64] = if label.starts_with(TYPE) {
            &[code::DECODE_FAILURE, code::INVALID_CONFIG]
        } else {
            &[code::INVALID_CONFIG]
        };
        assert_rejected(label, &out, codes, &net, &pod);
    }
    // CHECK needs the prevResult it verifies against.
    let out = net.pod_call("CHECK", &pod, &net.conf(V)).run();
    assert_rejected(
        "CHECK without prevResult",
        &out,
        &[code::INVALID_CONFIG],
        &net,
        &pod,
    );
}

#[test]
fn ipam_plugin_missing_from_cni_path() {
    let _turn = crate::turn::take(module_path!());
    let net = TestNet::new("nip", &["10.201.14.0/24"]);
    let pod = Pod::new("nip");
    let conf = with(&net, |c| c["ipam"]["type"] = json!("flt-no-such-ipam"));
    let out = net.pod_call("ADD", &pod, &conf).run();
    let e = out.error();
    assert!(
        e.msg.contains("flt-no-such-ipam")
            || e.details.unwrap_or_default().contains("flt-no-such-ipam"),
        "error names the missing plugin: {}",
        out.stdout
    );
    assert_rejected("missing IPAM plugin", &out, &[e.code], &net, &pod);
    assert!(e.code != 0, "a code is set");
    // The same with CNI_PATH pointing at an empty directory: even the
    // reference host-local is not found.
    let empty = flowlane_e2e::fsutil::TempDir::new("nip");
    let conf = with(&net, |c| c["ipam"]["type"] = json!("host-local"));
    let out = net
        .pod_call("ADD", &pod, &conf)
        .cni_path(&empty.str())
        .run();
    let e = out.error();
    assert_rejected("host-local not in CNI_PATH", &out, &[e.code], &net, &pod);
}

#[test]
fn ifname_already_in_the_pod_is_refused_and_kept() {
    let _turn = crate::turn::take(module_path!());
    let net = TestNet::new("dup", &["10.201.15.0/24"]);
    let pod = Pod::new("dup");
    pod.netns
        .ip(&[
            "link", "add", "eth0", "type", "veth", "peer", "name", "keep0",
        ])
        .expect_ok("pre-existing eth0");
    let out = net.pod_call("ADD", &pod, &net.conf(V)).run();
    let e = out.error();
    assert!(!out.success());
    let mut links: Vec<String> = pod.netns.links().into_iter().map(|l| l.ifname).collect();
    links.sort();
    assert_eq!(
        links,
        vec!["eth0", "keep0", "lo"],
        "the pod's own eth0 must survive"
    );
    net.assert_clean(&[&pod.id]);
    assert!(
        e.code == code::INVALID_ENV || e.code >= 100 || e.code == code::INVALID_CONFIG,
        "code {}",
        e.code
    );
}

#[test]
fn address_exhaustion_fails_cleanly_and_recovers() {
    let _turn = crate::turn::take(module_path!());
    let net = TestNet::new("exh", &["10.201.16.0/24"]);
    let conf = with(
        &net,
        |c| c["ipam"]["ranges"] = json!([[{"subnet": "10.201.16.0/24", "rangeStart": "10.201.16.10", "rangeEnd": "10.201.16.11"}]]),
    );
    let a = Pod::new("exa");
    let b = Pod::new("exb");
    let c = Pod::new("exc");
    let ra = net.pod_call("ADD", &a, &conf).run().expect_json();
    let rb = net.pod_call("ADD", &b, &conf).run().expect_json();
    let out = net.pod_call("ADD", &c, &conf).run();
    let e = out.error();
    assert!(
        e.code >= 100 || e.code == code::TRY_AGAIN_LATER,
        "exhaustion code {}: {}",
        e.code,
        e.msg
    );
    let links: Vec<String> = c.netns.links().into_iter().map(|l| l.ifname).collect();
    assert_eq!(links, vec!["lo"], "failed ADD left a link in the pod");
    assert_eq!(
        net.leases().len(),
        2,
        "only the two successful pods hold leases"
    );
    assert_eq!(
        flowlane_e2e::host::bridge_ports(&net.name).len(),
        2,
        "no veth leaked"
    );
    // Releasing one makes room again.
    let mut del_conf = conf.clone();
    del_conf["prevResult"] = ra;
    net.pod_call("DEL", &a, &del_conf).run().expect_ok();
    let rc = net.pod_call("ADD", &c, &conf).run().expect_json();
    for (p, r) in [(&b, rb), (&c, rc)] {
        let mut d = conf.clone();
        d["prevResult"] = r;
        net.pod_call("DEL", p, &d).run().expect_ok();
    }
    net.assert_clean(&[&a.id, &b.id, &c.id]);
}

#[test]
fn unusable_state_dir_fails_add_without_leaks() {
    let _turn = crate::turn::take(module_path!());
    let net = TestNet::new("sdir", &["10.201.17.0/24"]);
    let pod = Pod::new("sdir");
    // A state dir below a regular file can never be created, even by root.
    let file = net.dir.join("plainfile");
    std::fs::write(&file, b"x").unwrap();
    let conf = with(&net, |c| {
        c["stateDir"] = json!(file.join("state").display().to_string())
    });
    if net.plugin == flowlane_e2e::binaries::PluginUnderTest::Reference {
        return; // stateDir is flowlane's
    }
    let out = net.pod_call("ADD", &pod, &conf).run();
    assert_rejected(
        "state dir under a file",
        &out,
        &[code::IO_FAILURE],
        &net,
        &pod,
    );
}

#[test]
fn logs_never_reach_stdout() {
    let _turn = crate::turn::take(module_path!());
    let net = TestNet::new("log", &["10.201.18.0/24"]);
    let pod = Pod::new("log");
    // Outside the network's dir: a log may name the container, a leak check must not see it.
    let logdir = flowlane_e2e::fsutil::TempDir::new("logf");
    let logfile = logdir.join("plugin.log");
    let conf = with(&net, |c| {
        c["logFile"] = json!(logfile.display().to_string())
    });
    for level in ["trace", "debug"] {
        // ADD at maximum verbosity: stdout is exactly the result.
        let out = net
            .pod_call("ADD", &pod, &conf)
            .env("RUST_LOG", level)
            .run();
        let res = out.expect_json();
        flowlane_e2e::result::expect_valid(V, &res);
        let bad = net
            .pod_call("ADD", &pod, &conf)
            .env("RUST_LOG", level)
            .env("CNI_COMMAND", "FROB")
            .run();
        bad.error();
        let mut d = conf.clone();
        d["prevResult"] = res;
        let out = net.pod_call("DEL", &pod, &d).env("RUST_LOG", level).run();
        out.expect_ok();
        assert!(
            out.stdout.trim().is_empty(),
            "DEL prints nothing on stdout: {}",
            out.stdout
        );
    }
    // A log file that cannot be opened never breaks the plugin, nor stdout.
    let conf = with(&net, |c| {
        c["logFile"] = json!("/proc/flt-no-such-dir/plugin.log")
    });
    let res = net.pod_call("ADD", &pod, &conf).run().expect_json();
    let mut d = conf.clone();
    d["prevResult"] = res;
    net.pod_call("DEL", &pod, &d).run().expect_ok();
    net.assert_clean(&[&pod.id]);
}

#[test]
fn no_cni_command_is_not_a_plugin_call() {
    let _turn = crate::turn::take(module_path!());
    // Without CNI_COMMAND the binary is not being run as a plugin: it must not
    // wire anything, whatever stdin holds.
    let net = TestNet::new("nocmd", &["10.201.19.0/24"]);
    let pod = Pod::new("nocmd");
    let out = net
        .pod_call("ADD", &pod, &net.conf(V))
        .unset("CNI_COMMAND")
        .run();
    assert!(
        !out.stdout.contains("\"ips\""),
        "printed a result: {}",
        out.stdout
    );
    let links: Vec<String> = pod.netns.links().into_iter().map(|l| l.ifname).collect();
    assert_eq!(links, vec!["lo"]);
    net.assert_clean(&[&pod.id]);
    // Unused netns guard type kept in scope for clarity of ownership.
    let _: &Netns = &pod.netns;
}

#[test]
fn missing_cni_path_is_rejected_with_code_4() {
    let _turn = crate::turn::take(module_path!());
    // The spec lists CNI_PATH among the parameters a runtime always passes;
    // the reference plugins (skel) refuse to run without it.
    let net = TestNet::new("npath", &["10.201.20.0/24"]);
    let pod = Pod::new("npath");
    let out = net
        .pod_call("ADD", &pod, &net.conf(V))
        .unset("CNI_PATH")
        .run();
    let _del = flowlane_e2e::cni::DelOnDrop::new(net.pod_call("DEL", &pod, &net.conf(V)));
    assert_rejected("missing CNI_PATH", &out, &[code::INVALID_ENV], &net, &pod);
}

#[test]
fn netns_path_that_is_not_a_netns_is_rejected() {
    let _turn = crate::turn::take(module_path!());
    // A path that exists but is no network namespace (a runtime bug or a
    // stale path reused by a file): refuse it before touching links.
    let net = TestNet::new("nsfile", &["10.201.21.0/24"]);
    let pod = Pod::new("nsfile");
    let out = net
        .pod_call("ADD", &pod, &net.conf(V))
        .netns("/etc/hostname")
        .run();
    assert_rejected(
        "netns path that is not a netns",
        &out,
        &[code::UNKNOWN_CONTAINER, code::INVALID_ENV],
        &net,
        &pod,
    );
}

#[test]
fn bridge_name_taken_by_a_non_bridge_link() {
    let _turn = crate::turn::take(module_path!());
    let net = TestNet::new("nbr", &["10.201.22.0/24"]);
    let pod = Pod::new("nbr");
    // Occupy the bridge's name with a veth.
    flowlane_e2e::process::sh(&[
        "ip",
        "link",
        "add",
        &net.name,
        "type",
        "veth",
        "peer",
        "name",
        &format!("{}p", &net.name[..net.name.len().min(14)]),
    ])
    .expect_ok("veth with the bridge's name");
    let out = net.pod_call("ADD", &pod, &net.conf(V)).run();
    let e = out.error();
    assert!(
        e.code == code::INVALID_CONFIG || e.code >= 100,
        "code {}: {}",
        e.code,
        e.msg
    );
    assert_rejected("bridge name is a veth", &out, &[e.code], &net, &pod);
    let still = flowlane_e2e::host::link(&net.name).expect("the veth is left alone");
    assert_ne!(still.link_type, "bridge");
}
