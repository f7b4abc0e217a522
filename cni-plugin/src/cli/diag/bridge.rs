//! The node side of the pod network: the bridge named in the config exists,
//! is up, carries the gateway addresses, and the pod subnets route to it.

use std::path::Path;

use super::cni_config::FlowlaneNet;
use super::netinfo::{self, IfAddr, Route};
use super::report::Section;

pub fn check(net: Option<&FlowlaneNet>) -> Section {
    let mut s = Section::new("bridge", "Bridge, addresses and routes");
    let Some(net) = net else {
        s.info(
            "bridge.skipped",
            "no usable flowlane config, so no bridge to check",
        );
        return s;
    };
    if net.chained {
        s.info(
            "bridge.chained",
            format!(
                "flowlane is chained after {}: links and routes are that plugin's",
                net.plugin_types[0]
            ),
        );
        return s;
    }
    let br = &net.bridge;
    let link = netinfo::link_state(Path::new("/sys/class/net"), br);
    let addrs: Vec<IfAddr> = netinfo::addresses()
        .into_iter()
        .filter(|a| &a.ifname == br)
        .collect();
    let routes: Vec<Route> = netinfo::routes();
    s.data = serde_json::json!({
        "bridge": br,
        "link": link,
        "addresses": addrs.iter().map(|a| a.addr.to_string()).collect::<Vec<_>>(),
        "routes": routes.iter().filter(|r| &r.dev == br).collect::<Vec<_>>(),
    });

    if !link.exists {
        s.error(
            "bridge.missing",
            format!("bridge {br} does not exist"),
            "the plugin creates it on the first pod ADD; if pods already run, they have lost \
             their network: recreate the pods (or the node's network) so CNI ADD runs again",
        );
        return s;
    }
    if !link.is_bridge {
        s.error(
            "bridge.not_a_bridge",
            format!("{br} exists but is not a bridge"),
            format!(
                "rename the other interface or set \"bridge\" in {} to a free name",
                net.file.display()
            ),
        );
        return s;
    }
    if !link.admin_up {
        s.error(
            "bridge.down",
            format!("bridge {br} is administratively down: pods cannot reach their gateway"),
            format!("ip link set {br} up"),
        );
    } else {
        s.ok(
            "bridge.up",
            format!(
                "bridge {br} is up (operstate {}, {} port(s), mtu {})",
                link.operstate,
                link.ports,
                link.mtu.map(|m| m.to_string()).unwrap_or("?".into())
            ),
        );
    }

    for range in &net.ranges {
        let subnet = range.subnet;
        if net.is_gateway {
            match range.effective_gateway() {
                Some(gw) if addrs.iter().any(|a| a.addr.ip() == gw) => s.ok(
                    "bridge.gateway_ok",
                    format!("{br} has the gateway {gw} of {subnet}"),
                ),
                Some(gw) => s.error(
                    "bridge.gateway_missing",
                    format!(
                        "{br} lacks the gateway {gw} of {subnet} (it has: {})",
                        list(addrs.iter().map(|a| a.addr.to_string()))
                    ),
                    format!("ip addr add {gw}/{} dev {br}", subnet.prefix()),
                ),
                None => {}
            }
        } else {
            s.info(
                "bridge.no_gateway_configured",
                format!("isGateway is false: {subnet} has no gateway on {br} (pods are L2-only)"),
            );
        }
        let via_bridge = routes.iter().any(|r| {
            &r.dev == br && r.dst.prefix() == subnet.prefix() && r.dst.network() == subnet.network()
        });
        if via_bridge {
            s.ok("bridge.route_ok", format!("{subnet} routes to {br}"));
        } else if net.is_gateway {
            let other = routes
                .iter()
                .find(|r| r.dst.contains(subnet.network()) && r.dst.prefix() > 0);
            s.error(
                "bridge.route_missing",
                match other {
                    Some(r) => format!("{subnet} does not route to {br} but to {} ({})", r.dev, r.dst),
                    None => format!("no route sends {subnet} to {br}"),
                },
                format!(
                    "the route comes with the gateway address; add it (ip addr add <gateway>/{} dev {br}) \
                     and remove any conflicting route",
                    subnet.prefix()
                ),
            );
        }
    }
    if let Some(def) = routes
        .iter()
        .find(|r| r.dst.prefix() == 0 && r.dst.is_ipv4())
    {
        s.info(
            "bridge.default_route",
            format!(
                "node default route: via {} dev {}",
                def.gateway.map(|g| g.to_string()).unwrap_or("-".into()),
                def.dev
            ),
        );
    }
    s
}

fn list(items: impl Iterator<Item = String>) -> String {
    let v: Vec<String> = items.collect();
    if v.is_empty() {
        "no addresses".into()
    } else {
        v.join(", ")
    }
}
