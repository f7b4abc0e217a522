//! Cross-node pod routing and the cluster's masquerade exemptions, kept by
//! `flowlaned` from its cross-node view (`nodes.rs`): after every refresh
//! of the node table, [`reconcile`] makes the kernel match
//! [`plan::plan`]'s answer.
//!
//! - `host-gw`: a route per other node's pod CIDR via its underlay address;
//! - `vxlan`: device [`kernel::VXLAN_DEV`] (VNI 1, UDP 8472, learning off,
//!   local = this node's underlay address), a permanent FDB and neighbour
//!   entry per peer and an onlink route per peer's pod CIDR through it;
//! - `auto` (default): per peer, host-gw when its underlay address is on a
//!   directly connected subnet of this node, else vxlan.
//!
//! Routes carry protocol [`kernel::RTPROT_FLOWLANE`]: reconcile lists,
//! changes and deletes only those, never a route someone else made (one to
//! the same prefix stays, and wins). Nothing is removed when the daemon
//! stops, so pods keep their connectivity across a restart; uninstall runs
//! `flowlaned --remove-pod-routes` ([`remove_all`]).

pub mod kernel;
pub mod plan;

use std::sync::Arc;

use flowlane_netlink::exempt::{self, Owner};
use flowlane_netlink::RtNetlink;
use flowlane_rdma::topology::ClusterView;

pub use plan::Mode;

/// Makes the kernel match the plan for `view` (one round, blocking).
pub fn reconcile(view: &ClusterView, me: &str, mode: Mode) -> anyhow::Result<()> {
    let Some(my_underlay) = view.node(me).map(|n| n.underlay) else {
        // Without this node's entry there is no underlay address to plan
        // from; what is installed stays (a table being rewritten must not
        // cut the pods off).
        tracing::warn!(
            node = me,
            "this node is not in the node table; pod routes left as they are"
        );
        return Ok(());
    };
    let mut nl = RtNetlink::open()?;
    let vx_index = kernel::link_index(&mut nl, kernel::VXLAN_DEV)?;
    let (connected, mtu) = kernel::connected(&mut nl, vx_index.as_slice(), Some(my_underlay))?;
    // Addresses inside a pod CIDR (the pod bridges) are not the underlay.
    let connected: Vec<_> = connected
        .into_iter()
        .filter(|c| {
            !view
                .nodes()
                .iter()
                .any(|n| n.pod_cidrs.iter().any(|p| p.contains(c.ip())))
        })
        .collect();
    let want = plan::plan(view.nodes(), me, &connected, mode);

    // Exemptions first: a pod's first packet to a new node must not be NATed.
    let exempt: Vec<_> = want.exempt.iter().copied().collect();
    match exempt::sync(Owner::Node, &exempt, false) {
        Ok((0, 0)) => {}
        Ok((added, removed)) => tracing::info!(added, removed, "masquerade exemptions updated"),
        Err(e) => tracing::warn!(error = %e, "cannot update the masquerade exemptions"),
    }

    let vx_index = match &want.vtep {
        Some(vtep) => {
            let i = kernel::ensure_vxlan(&mut nl, vtep, mtu)?;
            kernel::sync_peers(&mut nl, i, &want.peers)?;
            Some(i)
        }
        None => {
            if kernel::remove_vxlan(&mut nl)? {
                tracing::info!(
                    device = kernel::VXLAN_DEV,
                    "no VXLAN peer left; device removed"
                );
            }
            None
        }
    };

    let have = kernel::own_routes(&mut nl)?;
    let forms: Vec<_> = want
        .routes
        .iter()
        .map(|r| (r, kernel::installed_form(r, vx_index)))
        .collect();
    for h in have
        .iter()
        .filter(|h| !forms.iter().any(|(_, f)| h.satisfies(f)))
    {
        kernel::del_route(&mut nl, h)?;
        tracing::info!(dst = %h.dst, gw = ?h.gw, "pod route removed");
    }
    for (r, _) in forms
        .iter()
        .filter(|(_, f)| !have.iter().any(|h| h.satisfies(f)))
    {
        match kernel::add_route(&mut nl, r, vx_index) {
            Ok(()) => tracing::info!(dst = %r.dst, via = ?r.via, "pod route added"),
            Err(e) if flowlane_netlink::errno(&e) == libc::EEXIST => {
                tracing::warn!(dst = %r.dst, "a route to this pod CIDR exists that flowlane did not make; leaving it")
            }
            Err(e) => {
                tracing::warn!(dst = %r.dst, via = ?r.via, error = %e, "cannot add pod route")
            }
        }
    }
    Ok(())
}

/// Follows the view's refreshes on the current runtime (netlink off it).
pub fn start(nodes: Arc<crate::nodes::Nodes>, mode: Mode) {
    let mut views = nodes.subscribe();
    let me = nodes.node_name().to_string();
    tracing::info!(
        ?mode,
        "pod routes and masquerade exemptions follow the node table"
    );
    tokio::spawn(async move {
        loop {
            let view = views.borrow_and_update().clone();
            if let Some(view) = view {
                let me = me.clone();
                let done = tokio::task::spawn_blocking(move || reconcile(&view, &me, mode)).await;
                match done {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "pod route reconcile failed; retrying at the next refresh")
                    }
                    Err(e) => tracing::error!(error = %e, "pod route reconcile panicked"),
                }
            }
            if views.changed().await.is_err() {
                return;
            }
        }
    });
}

/// What `--remove-pod-routes` removed.
#[derive(Debug, Default)]
pub struct Removed {
    pub routes: usize,
    pub vxlan: bool,
    pub exemptions: usize,
}

/// Removes all of flowlane's routes, the VXLAN device and the masquerade
/// exemptions (uninstall).
pub fn remove_all() -> anyhow::Result<Removed> {
    let mut nl = RtNetlink::open()?;
    let mut r = Removed::default();
    for h in kernel::own_routes(&mut nl)? {
        kernel::del_route(&mut nl, &h)?;
        r.routes += 1;
    }
    r.vxlan = kernel::remove_vxlan(&mut nl)?;
    r.exemptions = exempt::remove_all()?;
    Ok(r)
}
