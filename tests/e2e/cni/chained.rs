//! flowlane in chained mode after Debian's reference `bridge` + `host-local`,
//! run as libcni runs a conflist: bridge wires the pod, flowlane gets its
//! result as prevResult, records the pod in the registry, passes the result
//! on unchanged and wires nothing. Then the shared-memory lane between two
//! chained pods with a real `flowlaned` and the preload library. Needs root.
//!
//! Names start with `ch`, addresses come from 10.232.0.0/16.

use serde_json::{json, Value};

use flowlane_e2e::binaries::{PluginUnderTest, REFERENCE_CNI_DIR};
use flowlane_e2e::cni::{code, Chain, ChainAttachment, Invocation, Pod, TestNet};
use flowlane_e2e::fsutil::TempDir;
use flowlane_e2e::host::LinkGuard;
use flowlane_e2e::netns::Netns;
use flowlane_e2e::process::sh;
use flowlane_e2e::shm::{self, Node};

/// `ch<tag><pid digits>`, at most 15 bytes, unique per test and process.
fn ch_name(tag: &str) -> String {
    let name = format!("ch{tag}{:05}", std::process::id() % 100_000);
    assert!(name.len() <= 15, "{name}");
    name
}

/// A pod with a `ch` netns.
fn ch_pod(tag: &str) -> Pod {
    let netns = Netns::named(&ch_name(tag));
    Pod {
        id: format!("ch-{}-{}", netns.name(), std::process::id()),
        cni_args: format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=ch-ns;K8S_POD_NAME={};K8S_POD_UID=uid-{}",
            netns.name(),
            netns.name()
        ),
        ifname: "eth0".into(),
        netns,
    }
}

/// The reference bridge network `ch<tag>…` on `subnet`, and the conflist
/// bridge → flowlane (chained) with flowlane's state in the network's dir.
fn chained(tag: &str, subnet: &str, daemon_socket: Option<&str>) -> (TestNet, Chain) {
    let name = ch_name(tag);
    let net = TestNet {
        plugin: PluginUnderTest::Reference,
        bridge: LinkGuard::new(&name),
        name,
        subnets: vec![subnet.to_string()],
        dir: TempDir::new(tag),
    };
    let mut bridge = net.conf("1.0.0");
    for k in ["cniVersion", "name", "stateDir", "daemonSocket"] {
        bridge.as_object_mut().unwrap().remove(k);
    }
    let socket = daemon_socket
        .map(str::to_string)
        .unwrap_or_else(|| net.dir.join("no-daemon.sock").display().to_string());
    let own_dir = flowlane_e2e::binaries::flowlane()
        .parent()
        .unwrap()
        .display()
        .to_string();
    let chain = Chain {
        name: net.name.clone(),
        version: "1.0.0".into(),
        cni_path: format!("{own_dir}:{REFERENCE_CNI_DIR}"),
        plugins: vec![
            bridge,
            json!({"type": "flowlane", "mode": "chained",
                   "stateDir": net.state_dir().display().to_string(),
                   "daemonSocket": socket}),
        ],
    };
    (net, chain)
}

/// flowlane's entry of the chain as a complete config for `version`.
fn flowlane_conf(chain: &Chain, version: &str, prev: Option<&Value>) -> Value {
    let mut c = chain.plugins[1].clone();
    c["name"] = json!(chain.name);
    c["cniVersion"] = json!(version);
    if let Some(p) = prev {
        c["prevResult"] = p.clone();
    }
    c
}

fn flowlane_call(chain: &Chain, command: &str, pod: &Pod, conf: &Value) -> Invocation {
    Invocation::new(flowlane_e2e::binaries::flowlane(), command)
        .cni_path(&chain.cni_path)
        .container_id(&pod.id)
        .netns(pod.netns.path_str())
        .ifname(&pod.ifname)
        .args(&pod.cni_args)
        .config(conf)
}

/// What flowlane could have changed: the pod's links and routes, the
/// bridge's ports, host routes of the test's subnet, and packet filter
/// rules naming the container or the network.
fn wiring(net: &TestNet, pod: &Pod) -> Vec<String> {
    let mut out: Vec<String> = pod
        .netns
        .ip(&["-o", "link"])
        .stdout
        .lines()
        .chain(
            pod.netns
                .ip(&["route", "show", "table", "all"])
                .stdout
                .lines(),
        )
        .chain(
            pod.netns
                .ip(&["-6", "route", "show", "table", "all"])
                .stdout
                .lines(),
        )
        .map(str::to_string)
        .collect();
    out.extend(
        flowlane_e2e::host::bridge_ports(&net.name)
            .into_iter()
            .map(|l| l.ifname),
    );
    // This test's subnets only: the suite's other tests wire their own
    // 10.232.x networks at the same time (two test threads), and a route
    // of theirs coming or going between two snapshots is not this test's.
    let prefixes: Vec<String> = net
        .subnets
        .iter()
        .map(|s| s.trim_end_matches(".0/24").to_string() + ".")
        .collect();
    out.extend(
        sh(&["ip", "route", "show", "table", "all"])
            .stdout
            .lines()
            .filter(|l| l.contains(&net.name) || prefixes.iter().any(|p| l.contains(p.as_str())))
            .map(str::to_string),
    );
    let rules = format!(
        "{}\n{}",
        sh(&["nft", "list", "ruleset"]).stdout,
        sh(&["iptables", "-w", "-t", "nat", "-S"]).stdout
    );
    out.extend(
        rules
            .lines()
            .filter(|l| l.contains(&pod.id) || l.contains(&net.name) || l.contains("flowlane"))
            .map(str::to_string),
    );
    out
}

#[test]
fn bridge_then_flowlane_chained_records_the_pod_and_wires_nothing() {
    let _turn = crate::turn::take(module_path!());
    let (net, chain) = chained("a", "10.232.1.0/24", None);
    let pod = ch_pod("ap");

    // libcni's ADD, step by step: bridge, then flowlane with bridge's result.
    let bridge_res = net
        .pod_call("ADD", &pod, &{
            let mut c = chain.plugins[0].clone();
            c["name"] = json!(chain.name);
            c["cniVersion"] = json!(chain.version);
            c
        })
        .run()
        .expect_json();
    let before = wiring(&net, &pod);
    let add = flowlane_call(
        &chain,
        "ADD",
        &pod,
        &flowlane_conf(&chain, "1.0.0", Some(&bridge_res)),
    )
    .run();
    let res = add.expect_json();
    assert_eq!(res, bridge_res, "flowlane passes bridge's result on");
    assert_eq!(wiring(&net, &pod), before, "flowlane wired something");

    // The registry entry primary mode would write.
    let entries = net.registry_entries();
    assert_eq!(entries.len(), 1, "{entries:?}");
    let e = &entries[0];
    let ip = res["ips"][0]["address"].as_str().unwrap();
    assert_eq!(e.ips, [ip.to_string()]);
    assert!(ip.starts_with("10.232.1."), "{ip}");
    assert_eq!(e.netns, pod.netns.path_str());
    assert_eq!(e.netns_inode, pod.netns.inode());
    assert_eq!(e.container_id, pod.id);
    assert_eq!(e.ifname, "eth0");
    assert_eq!(e.mac, pod.netns.link("eth0").unwrap().address);
    assert_eq!(e.pod_name.as_deref(), Some(pod.netns.name()));

    // CHECK through the whole chain; a prevResult the entry does not match.
    for out in chain.check(&pod, &res) {
        out.expect_ok();
    }
    let mut other = res.clone();
    other["ips"][0]["address"] = json!("10.232.1.250/24");
    flowlane_call(
        &chain,
        "CHECK",
        &pod,
        &flowlane_conf(&chain, "1.0.0", Some(&other)),
    )
    .run()
    .expect_error(105);

    // Asked for 0.4.0: the same result in 0.4.0's format.
    let res04 = flowlane_call(
        &chain,
        "ADD",
        &pod,
        &flowlane_conf(&chain, "0.4.0", Some(&bridge_res)),
    )
    .run()
    .expect_json();
    assert_eq!(res04["cniVersion"], "0.4.0");
    assert_eq!(res04["ips"][0]["version"], "4");
    assert_eq!(res04["interfaces"], bridge_res["interfaces"]);

    // DEL in reverse order, then containerd's second DEL without netns and
    // prevResult: the entry is gone, bridge's lease and veth too.
    chain.del(&pod, Some(&res));
    assert!(net.registry_entries().is_empty());
    chain.del_without_netns(&pod);
    net.assert_clean(&[&pod.id]);
}

#[test]
fn chained_gc_status_and_bad_input() {
    let _turn = crate::turn::take(module_path!());
    let (net, chain) = chained("g", "10.232.2.0/24", None);
    let (keep, stale) = (ch_pod("gk"), ch_pod("gs"));
    let a = ChainAttachment::add(&chain, &keep);
    let b = ChainAttachment::add(&chain, &stale);
    assert_eq!(net.registry_entries().len(), 2);

    // GC (1.1.0) keeps the valid attachment's entry, drops the other.
    let mut gc = flowlane_conf(&chain, "1.1.0", None);
    gc["cni.dev/valid-attachments"] = json!([{"containerID": keep.id, "ifname": "eth0"}]);
    Invocation::new(flowlane_e2e::binaries::flowlane(), "GC")
        .cni_path(&chain.cni_path)
        .config(&gc)
        .run()
        .expect_ok();
    let left: Vec<String> = net
        .registry_entries()
        .into_iter()
        .map(|e| e.container_id)
        .collect();
    assert_eq!(left, std::slice::from_ref(&keep.id));
    Invocation::new(flowlane_e2e::binaries::flowlane(), "STATUS")
        .cni_path(&chain.cni_path)
        .config(&flowlane_conf(&chain, "1.1.0", None))
        .run()
        .expect_ok();

    // No prevResult, or one without the pod's interface: error 7 on
    // stdout, no entry written.
    let pod = ch_pod("gb");
    let no_prev = flowlane_call(&chain, "ADD", &pod, &flowlane_conf(&chain, "1.0.0", None)).run();
    let e = no_prev.expect_error(code::INVALID_CONFIG);
    assert!(e.msg.contains("prevResult"), "{}", e.msg);
    let host_only = json!({"cniVersion": "1.0.0", "interfaces": [{"name": "x"}],
                           "ips": [{"address": "10.232.2.9/24", "interface": 0}]});
    flowlane_call(
        &chain,
        "ADD",
        &pod,
        &flowlane_conf(&chain, "1.0.0", Some(&host_only)),
    )
    .run()
    .expect_error(code::INVALID_CONFIG);
    flowlane_call(&chain, "CHECK", &pod, &flowlane_conf(&chain, "1.0.0", None))
        .run()
        .expect_error(code::INVALID_CONFIG);
    assert_eq!(net.registry_entries().len(), 1);

    b.detach();
    a.detach();
    net.assert_clean(&[&keep.id, &stale.id, &pod.id]);
}

/// Two chained pods on one node, a real flowlaned reading the registry the
/// chained plugin wrote: an unmodified Python echo pair with the preload
/// library rides the shared-memory lane.
#[test]
fn chained_pods_get_the_shared_memory_lane() {
    let _turn = crate::turn::take(module_path!());
    let _heavy = shm::heavy();
    // The harness's node brings the daemon (its own bridge stays unused).
    let node = Node::new("chn", 0);
    let socket = node.socket().display().to_string();
    let (net, mut chain) = chained("s", "10.232.3.0/24", Some(&socket));
    chain.plugins[1]["stateDir"] = json!(node.state_dir().display().to_string());
    let (pc, ps) = (ch_pod("sc"), ch_pod("ss"));
    let ac = ChainAttachment::add(&chain, &pc);
    let as_ = ChainAttachment::add(&chain, &ps);
    let ip_of = |r: &Value| {
        r["ips"][0]["address"]
            .as_str()
            .unwrap()
            .split('/')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let shm_pod = |p: &Pod, r: &Value| shm::Pod {
        netns: p.netns.name().to_string(),
        ip: ip_of(r),
        container_id: p.id.clone(),
    };
    let (client, server) = (shm_pod(&pc, ac.result()), shm_pod(&ps, as_.result()));

    node.python_echo(&client, &server, 7101, 20_000_000);
    assert_eq!(
        node.shm_opened(),
        1,
        "the chained pods' connection must ride the shm lane; daemon log:\n{}",
        node.daemon_log()
    );
    as_.detach();
    ac.detach();
    let left = flowlane_registry::Registry::new(node.state_dir())
        .list()
        .unwrap();
    assert!(left.is_empty(), "{left:?}");
    net.assert_clean(&[&pc.id, &ps.id]);
}
