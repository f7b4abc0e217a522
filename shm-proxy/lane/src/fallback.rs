//! Why a connection stayed on TCP: the one vocabulary of the daemon's
//! fallback counters, `flowlane status` and the `flowlane_fallbacks_total`
//! metric. Each reason's name is written once, in [`FallbackReason::as_str`];
//! the wire form, the counters and the metric labels all derive from it.
//!
//! Some reasons are reported by the preload library (`ReportFallback`), the
//! rest are decided by the daemon itself (the broker, the relay). Only the
//! client-reported ones decode from the wire: a pod cannot inflate a counter
//! of a decision the daemon makes.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Why a connection stayed on TCP (counted by the daemon per reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FallbackReason {
    // Reported by the client (the preload library).
    /// The library could not reach its node's daemon.
    NoDaemon,
    /// The destination is not a pod on this node (and no relay carried it).
    NotLocalPod,
    /// The peer ran without the library.
    NoPeerLibrary,
    /// The socket's options or use are not ones the lane supports.
    Unsupported,
    /// The library failed internally (mapping the channel, ...).
    InternalError,
    /// Not a fallback at set-up: the peer wrote a shared-memory word the
    /// ring protocol does not allow, and the connection was reset.
    RingViolation,
    /// The relay's memory budget (`--relay-memory-budget`) had no room for
    /// another relayed connection: it stayed on TCP.
    RelayBudget,

    // Decided by the daemon.
    /// The destination pod has no flowlane listener on that port.
    NoListener,
    /// A server accepted a connection nobody announced (peer without the
    /// library, another node, or an expired intent).
    ClaimWithoutIntent,
    /// The server never claimed the channel in time.
    IntentExpired,
    /// The client's connect failed after the intent.
    IntentCancelled,
    /// The answer to an intent could not be sent: the client had stopped
    /// waiting for it.
    IntentUndelivered,
    /// The caller was not allowed (unknown pod, foreign address).
    AuthFailed,
    /// The requested region exceeded the daemon's bound (`--max-region`).
    RegionTooLarge,
    /// The requested region is below the smallest ring the daemon makes.
    RegionTooSmall,
    /// The calling pod has `--max-pending-per-pod` intents waiting already.
    TooManyPending,
    /// The calling pod has no address of the destination's family.
    NoSourceAddress,
    /// The daemon failed to create the channel.
    DaemonError,
    /// The peer daemon's lane could not be opened.
    RelayLaneUnreachable,
    /// The daemon could not take the pod's socket or map its channel.
    RelaySetupFailed,
    /// The client pod gave up (or never mapped its channel) before the claim.
    RelayRefused,
    /// The server daemon refused the stream (see `stream_foreign_client` /
    /// `stream_duplicate` in its lane errors).
    RelayStreamRefused,
    /// A connection to a Service IP whose backend the node's conntrack
    /// table did not name when the client asked (no entry yet, or the
    /// connection was also source-NATed, as kube-proxy does for a pod that
    /// reaches itself through its Service).
    ServiceUnresolved,
    /// A relayed claim whose client's daemon said a Service connection's
    /// stream was on its way, and the stream did not come in time (the
    /// client's set-up failed after it was asked).
    ServiceStreamMissed,
}

impl FallbackReason {
    /// Every reason, in declaration order.
    pub const ALL: [FallbackReason; 24] = [
        FallbackReason::NoDaemon,
        FallbackReason::NotLocalPod,
        FallbackReason::NoPeerLibrary,
        FallbackReason::Unsupported,
        FallbackReason::InternalError,
        FallbackReason::RingViolation,
        FallbackReason::RelayBudget,
        FallbackReason::NoListener,
        FallbackReason::ClaimWithoutIntent,
        FallbackReason::IntentExpired,
        FallbackReason::IntentCancelled,
        FallbackReason::IntentUndelivered,
        FallbackReason::AuthFailed,
        FallbackReason::RegionTooLarge,
        FallbackReason::RegionTooSmall,
        FallbackReason::TooManyPending,
        FallbackReason::NoSourceAddress,
        FallbackReason::DaemonError,
        FallbackReason::RelayLaneUnreachable,
        FallbackReason::RelaySetupFailed,
        FallbackReason::RelayRefused,
        FallbackReason::RelayStreamRefused,
        FallbackReason::ServiceUnresolved,
        FallbackReason::ServiceStreamMissed,
    ];

    /// Stable name: on the wire, in counters, `flowlane status` and the
    /// metric's `reason` label.
    pub const fn as_str(self) -> &'static str {
        match self {
            FallbackReason::NoDaemon => "no-daemon",
            FallbackReason::NotLocalPod => "not-local-pod",
            FallbackReason::NoPeerLibrary => "no-peer-library",
            FallbackReason::Unsupported => "unsupported",
            FallbackReason::InternalError => "internal-error",
            FallbackReason::RingViolation => "ring-violation",
            FallbackReason::RelayBudget => "relay-budget",
            FallbackReason::NoListener => "no-listener",
            FallbackReason::ClaimWithoutIntent => "claim-without-intent",
            FallbackReason::IntentExpired => "intent-expired",
            FallbackReason::IntentCancelled => "intent-cancelled",
            FallbackReason::IntentUndelivered => "intent-undelivered",
            FallbackReason::AuthFailed => "auth-failed",
            FallbackReason::RegionTooLarge => "region-too-large",
            FallbackReason::RegionTooSmall => "region-too-small",
            FallbackReason::TooManyPending => "too-many-pending",
            FallbackReason::NoSourceAddress => "no-source-address",
            FallbackReason::DaemonError => "daemon-error",
            FallbackReason::RelayLaneUnreachable => "relay-lane-unreachable",
            FallbackReason::RelaySetupFailed => "relay-setup-failed",
            FallbackReason::RelayRefused => "relay-refused",
            FallbackReason::RelayStreamRefused => "relay-stream-refused",
            FallbackReason::ServiceUnresolved => "service-unresolved",
            FallbackReason::ServiceStreamMissed => "service-stream-missed",
        }
    }

    /// Whether a client may report this reason (`ReportFallback`); the
    /// others are the daemon's own decisions.
    pub const fn client_reported(self) -> bool {
        matches!(
            self,
            FallbackReason::NoDaemon
                | FallbackReason::NotLocalPod
                | FallbackReason::NoPeerLibrary
                | FallbackReason::Unsupported
                | FallbackReason::InternalError
                | FallbackReason::RingViolation
                | FallbackReason::RelayBudget
        )
    }

    /// The reason named `name`, any of them.
    pub fn from_name(name: &str) -> Option<FallbackReason> {
        Self::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

impl std::fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for FallbackReason {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for FallbackReason {
    /// Accepts only the client-reported reasons (see the module header).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        FallbackReason::from_name(&name)
            .filter(|r| r.client_reported())
            .ok_or_else(|| {
                serde::de::Error::custom(format_args!("unknown fallback reason {name:?}"))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_kebab_case_and_listed_once() {
        let mut seen = std::collections::BTreeSet::new();
        for r in FallbackReason::ALL {
            let name = r.as_str();
            assert!(seen.insert(name), "{name} twice");
            assert!(name.chars().all(|c| c.is_ascii_lowercase() || c == '-'));
            assert_eq!(FallbackReason::from_name(name), Some(r));
        }
    }

    #[test]
    fn only_client_reported_reasons_decode_from_the_wire() {
        for r in FallbackReason::ALL {
            let json = serde_json::to_string(&r).unwrap();
            assert_eq!(json, format!("\"{}\"", r.as_str()));
            let back = serde_json::from_str::<FallbackReason>(&json);
            assert_eq!(back.ok(), r.client_reported().then_some(r), "{r}");
        }
        assert!(serde_json::from_str::<FallbackReason>("\"nonsense\"").is_err());
        assert!(serde_json::from_str::<FallbackReason>("7").is_err());
    }
}
