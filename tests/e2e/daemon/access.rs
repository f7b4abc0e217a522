//! Who the daemon socket answers (issue 11, part 3), tried as an attacker
//! would, as root with real network namespaces and the real `flowlaned`:
//! node-wide answers (stats, the registry poke) only for root or the admin
//! group in the node's network namespace; nothing for a process that made
//! itself a namespace (`unshare -n`), from the node or from a pod; close
//! reports only from the channel's pods and within reason; a dead pod's
//! registry entry lends nobody its identity.

use super::common as daemon_common;

use std::time::Duration;

use daemon_common::{runnable_by_anyone, Agent, Node};
use flowlane_e2e::netns::Netns;
use flowlane_registry::Attachment;

/// The answer of an agent refused by the daemon, with `why` in the message.
fn refused(answer: &str, why: &str) -> bool {
    answer.starts_with("err PermissionDenied") && answer.contains(why)
}

const NOT_ADMIN: &str = "need uid 0 or the daemon's admin group";
const NOT_NODE_NETNS: &str = "only in the node's network namespace";
const FROM_A_POD: &str = "not allowed from a pod";
const NO_POD: &str = "is not a pod of this node";

#[test]
fn a_non_admin_uid_on_the_node_gets_no_node_answers() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::start("acu", &["--admin-gid", "4242"]);
    let a = node.add_pod("a", "10.202.30.2");
    let b = node.add_pod("b", "10.202.30.3");
    let (mut pa, mut pb) = (a.agent(), b.agent());
    assert_eq!(pb.cmd("listen 0.0.0.0:7000"), "ok");
    pa.expect_channel("intent 0.0.0.0:46000 10.202.30.3:7000 65536");
    pb.expect_channel("claim 10.202.30.3:7000 10.202.30.2:46000");
    let before = node.stats();
    assert_eq!(before.connections.len(), 1);

    // nobody (65534) in the host network namespace.
    let mut nobody = Agent::spawn_as(65534, 65534, &node.socket);
    let st = nobody.cmd("stats");
    assert!(refused(&st, NOT_ADMIN), "{st}");
    let poke = nobody.cmd("registry-changed");
    assert!(refused(&poke, NOT_ADMIN), "{poke}");
    // Nor is it a pod.
    let l = nobody.cmd("listen 0.0.0.0:7001");
    assert!(refused(&l, NO_POD), "{l}");

    // `flowlane status` as that uid says why.
    let status_as = |uid: u32, gid: u32| {
        use std::os::unix::process::CommandExt;
        let flowlane = runnable_by_anyone(&flowlane_e2e::binaries::flowlane(), &node.socket);
        std::process::Command::new(flowlane)
            .args(["status", "--json", "--socket"])
            .arg(&node.socket)
            .uid(uid)
            .gid(gid)
            .output()
            .expect("flowlane status")
    };
    let out = status_as(65534, 65534);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("refused") && err.contains("--admin-gid"),
        "{err}"
    );

    // The same uid in the admin group (--admin-gid) is an administrator.
    let mut sre = Agent::spawn_as(65534, 4242, &node.socket);
    assert_eq!(sre.cmd("stats"), "ok");
    assert_eq!(sre.cmd("registry-changed"), "ok");
    let out = status_as(65534, 4242);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let st: flowlane_lane::proto::Stats = serde_json::from_slice(&out.stdout).expect("stats JSON");
    assert_eq!(st.connections.len(), 1);

    // And root on the node (what `flowlane status` and the CNI poke are).
    let after = node.stats();
    assert_eq!(after.auth_failures, before.auth_failures + 4);
    assert_eq!(
        after.daemon.registry_reloads,
        before.daemon.registry_reloads + 1
    );
}

#[test]
fn a_process_in_a_fresh_netns_gains_nothing() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::start("acn", &[]);
    let a = node.add_pod("a", "10.202.31.2");
    let b = node.add_pod("b", "10.202.31.3");
    let (mut pa, mut pb) = (a.agent(), b.agent());
    assert_eq!(pb.cmd("listen 0.0.0.0:7000"), "ok");

    // Root of the node, in a namespace of its own (`unshare -n`).
    let mut unshared = Agent::spawn_via(&["unshare", "-n"], &node.socket);
    for req in ["stats", "registry-changed"] {
        let r = unshared.cmd(req);
        assert!(refused(&r, NOT_NODE_NETNS), "{req}: {r}");
    }
    let r = unshared.cmd("intent 10.202.31.2:46000 10.202.31.3:7000 65536");
    assert!(refused(&r, NO_POD), "{r}");

    // A pod's process that leaves the pod's namespace: neither the node's
    // answers nor the pod's identity.
    let wrapper = ["ip", "netns", "exec", a.ns.name(), "unshare", "-n"];
    let mut escaped = Agent::spawn_via(&wrapper, &node.socket);
    for req in ["stats", "registry-changed"] {
        let r = escaped.cmd(req);
        assert!(refused(&r, NOT_NODE_NETNS), "{req}: {r}");
    }
    for req in [
        "intent 10.202.31.2:46001 10.202.31.3:7000 65536",
        "listen 10.202.31.2:7002",
        "claim 10.202.31.3:7000 10.202.31.2:46002",
        "fallback",
    ] {
        let r = escaped.cmd(req);
        assert!(refused(&r, NO_POD), "{req}: {r}");
    }

    // A pod itself, even as root: no node answers (it would see every
    // pod's connections); its own requests still work.
    for req in ["stats", "registry-changed"] {
        let r = pa.cmd(req);
        assert!(refused(&r, FROM_A_POD), "{req}: {r}");
    }
    pa.expect_channel("intent 0.0.0.0:46003 10.202.31.3:7000 65536");
    let st = node.stats();
    assert_eq!(st.lanes["shm"].channels_pending, 1);
    assert_eq!(st.auth_failures, 2 + 1 + 2 + 4 + 2);
}

#[test]
fn close_reports_for_another_pods_channel_change_nothing() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::start("acr", &[]);
    let a = node.add_pod("a", "10.202.32.2");
    let b = node.add_pod("b", "10.202.32.3");
    let c = node.add_pod("c", "10.202.32.4");
    let (mut pa, mut pb, mut pc) = (a.agent(), b.agent(), c.agent());
    assert_eq!(pb.cmd("listen 0.0.0.0:7000"), "ok");
    let id = pa.expect_channel("intent 0.0.0.0:46000 10.202.32.3:7000 65536");
    assert_eq!(
        pb.expect_channel("claim 10.202.32.3:7000 10.202.32.2:46000"),
        id
    );
    let before = node.stats();

    // A third pod reports the pair's channel closed, with huge counts.
    let r = pc.cmd(&format!("closed {id} 1099511627776 1099511627776"));
    assert!(refused(&r, "belongs to other pods"), "{r}");
    // A process that left pod a's namespace cannot speak for a either.
    let wrapper = ["ip", "netns", "exec", a.ns.name(), "unshare", "-n"];
    let mut escaped = Agent::spawn_via(&wrapper, &node.socket);
    let r = escaped.cmd(&format!("closed {id} 1099511627776 0"));
    assert!(refused(&r, NO_POD), "{r}");
    // The channel's own pod, with counts no connection could carry.
    for (sent, received) in [(u64::MAX, 0), (0, u64::MAX), (1u64 << 45, 1)] {
        let r = pa.cmd(&format!("closed {id} {sent} {received}"));
        assert!(r.starts_with("err InvalidInput"), "{r}");
    }
    // Ids nobody issued.
    assert_eq!(pc.cmd("closed 1 1099511627776 0"), "ok");
    assert_eq!(
        pc.cmd(&format!("closed {} 1099511627776 0", u64::MAX)),
        "ok"
    );

    let st = node.stats();
    assert_eq!(st.lanes["shm"].bytes, before.lanes["shm"].bytes);
    assert_eq!(st.lanes["shm"].connections_active, 1, "still open");
    assert_eq!(st.lanes["shm"].connections_closed, 0);
    assert_eq!(st.connections[0].bytes_client_to_server, 0);
    assert_eq!(st.auth_failures, before.auth_failures + 2);
    assert_eq!(st.bad_requests, before.bad_requests + 3);

    // The real ends close it, and their bytes count once.
    assert_eq!(pa.cmd(&format!("closed {id} 300 20")), "ok");
    assert_eq!(pb.cmd(&format!("closed {id} 20 300")), "ok");
    let st = node.stats();
    assert_eq!(st.lanes["shm"].connections_closed, 1);
    assert_eq!(st.lanes["shm"].bytes, 320);
    // Late reports change nothing.
    assert_eq!(pc.cmd(&format!("closed {id} 1099511627776 0")), "ok");
    assert_eq!(pa.cmd(&format!("closed {id} 1099511627776 0")), "ok");
    assert_eq!(node.stats().lanes["shm"].bytes, 320);
}

/// A registry entry as the CNI plugin writes it.
fn entry(container_id: &str, netns: String, inode: u64, ip: &str) -> Attachment {
    Attachment {
        network: "fldnet".into(),
        container_id: container_id.into(),
        ifname: "eth0".into(),
        netns,
        netns_inode: inode,
        ips: vec![format!("{ip}/17")],
        mac: "02:00:00:00:00:01".into(),
        pod_namespace: Some("default".into()),
        pod_name: Some(container_id.into()),
        pod_uid: None,
        created_unix: 0,
    }
}

fn poke(node: &Node) {
    flowlane_lane::notify::notify_registry_changed(&node.socket, Duration::from_secs(10))
        .expect("poke");
}

#[test]
fn a_dead_pods_entry_lends_its_identity_to_no_new_namespace() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::start("acs", &[]);
    let b = node.add_pod("b", "10.202.33.3");
    let mut pb = b.agent();
    assert_eq!(pb.cmd("listen 0.0.0.0:7000"), "ok");

    // Simulated: a crashed runtime's entry whose pinned namespace is gone,
    // recording the inode a fresh namespace has now.
    let fresh = Netns::named(&daemon_common::unique_name("fresh"));
    node.registry()
        .put(&entry(
            "ghost",
            "/var/run/netns/fld-ghost-gone".into(),
            fresh.inode(),
            "10.202.33.9",
        ))
        .expect("registry put");
    poke(&node);
    let mut in_fresh = Agent::spawn(&fresh, &node.socket);
    for req in [
        "listen 10.202.33.9:7001",
        "intent 10.202.33.9:46000 10.202.33.3:7000 65536",
        "fallback",
    ] {
        let r = in_fresh.cmd(req);
        assert!(refused(&r, NO_POD), "{req}: {r}");
    }
    let r = in_fresh.cmd("stats");
    assert!(r.starts_with("err PermissionDenied"), "{r}");
    assert_eq!(node.stats().daemon.pods, 1, "the ghost is no pod");

    // Real: a pod whose namespace goes without CNI DEL (entry kept), then
    // fresh namespaces until the kernel hands one its inode (nsfs inodes
    // are the lowest free number; other processes of the machine make
    // namespaces too, so this is tried, not guaranteed).
    let a = node.add_pod("a", "10.202.33.2");
    let mut pa = a.agent();
    assert_eq!(pa.cmd("listen 0.0.0.0:7002"), "ok");
    assert_eq!(node.stats().daemon.pods, 2);
    let dead_inode = a.ns.inode();
    drop(pa);
    // Deletes the namespace (Netns's drop); the registry entry stays.
    let a_ip = a.ip;
    drop(a.ns);
    let mut tried = Vec::new();
    let mut reused = None;
    for _ in 0..100 {
        let ns = Netns::named(&daemon_common::unique_name("reuse"));
        if ns.inode() == dead_inode {
            reused = Some(ns);
            break;
        }
        tried.push(ns);
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(tried);
    match reused {
        Some(ns) => {
            eprintln!("the kernel reused inode {dead_inode} for {}", ns.name());
            let mut squatter = Agent::spawn(&ns, &node.socket);
            let r = squatter.cmd(&format!("listen {a_ip}:7003"));
            assert!(refused(&r, "is stale"), "{r}");
            let r = squatter.cmd(&format!("intent {a_ip}:46001 10.202.33.3:7000 65536"));
            assert!(refused(&r, "is stale"), "{r}");
            // After a reread the stale entry is no pod at all.
            poke(&node);
            let r = squatter.cmd("fallback");
            assert!(refused(&r, NO_POD), "{r}");
        }
        None => {
            eprintln!("inode {dead_inode} not reused in 100 namespaces; the simulated case stands")
        }
    }
    poke(&node);
    assert_eq!(node.stats().daemon.pods, 1, "only b is a pod");
    // The live pod is unaffected.
    assert_eq!(pb.cmd("listen 0.0.0.0:7004"), "ok");
}
