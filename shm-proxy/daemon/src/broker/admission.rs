//! Admission of an intent and of a claim: the rules both lanes apply
//! before they set a connection up, the same-node lane (`connect_intent`,
//! `claim_accepted`) and the cross-node relay (`relay/`). One function
//! each, so the two answer every case alike. Intents:
//!
//! | case | answer | counted as |
//! |---|---|---|
//! | caller is no (live) pod of this node | `unknown-pod` | `auth-failed` |
//! | destination port 0, or source port 0 without the caller's socket | `bad-request` | nothing (a malformed request) |
//! | region below `min_region` | `bad-request` | `region-too-small` |
//! | region above `max_region` | `too-large` | `region-too-large` |
//! | `src` an address the pod does not own | `forbidden` | `auth-failed` |
//! | `src` unspecified, pod has no address of `dst`'s family | no channel | `no-source-address` |

use std::net::SocketAddr;

use flowlane_lane::proto::{ErrorCode, FallbackReason, NoChannelReason, Response};

use super::{Answer, Broker, Caller};
use crate::pods::PodId;

/// An intent the caller may make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    /// The calling pod.
    pub client_pod: PodId,
    /// The connection's source, the pod's IP filled in when it was
    /// unspecified.
    pub src: SocketAddr,
}

impl Broker {
    /// Checks an intent from `caller` for a connection `src` -> `dst` with
    /// a region of `region_len` bytes (see the module header for the
    /// answers). A refusal is counted here; the caller returns it as is.
    ///
    /// `src` may have port 0 (the socket is not bound yet; its `connect`
    /// picks the port) only when the caller named its socket
    /// (`with_socket`): the daemon then reads the port from the socket
    /// itself (`channels.rs`, "portless intents").
    pub fn admit_intent(
        &mut self,
        caller: &Caller,
        src: SocketAddr,
        dst: SocketAddr,
        region_len: u64,
        with_socket: bool,
    ) -> Result<Admitted, Answer> {
        let client_pod = self.caller_pod(caller).inspect_err(|_| {
            self.counters.fallback(FallbackReason::AuthFailed);
        })?;
        if dst.port() == 0 || (src.port() == 0 && !with_socket) {
            return Err(Response::error(ErrorCode::BadRequest, "port 0 in an intent").into());
        }
        let (min, max) = (self.limits.min_region, self.limits.max_region);
        let out_of_bounds = if region_len < min {
            Some((
                FallbackReason::RegionTooSmall,
                ErrorCode::BadRequest,
                format!("region of {region_len} bytes is below the minimum {min}"),
            ))
        } else if region_len > max {
            Some((
                FallbackReason::RegionTooLarge,
                ErrorCode::TooLarge,
                format!("region of {region_len} bytes exceeds the maximum {max}"),
            ))
        } else {
            None
        };
        if let Some((reason, code, message)) = out_of_bounds {
            self.counters.fallback(reason);
            return Err(Response::error(code, message).into());
        }
        let src_ip = if src.ip().is_unspecified() {
            // Not the pod's fault: it has no address to reach `dst` from
            // (an IPv4-only pod connecting to an IPv6 address).
            match self
                .pods
                .get(client_pod)
                .and_then(|p| p.source_for(dst.ip()))
            {
                Some(ip) => ip,
                None => {
                    return Err(self.no_channel(
                        NoChannelReason::NotLocalPod,
                        FallbackReason::NoSourceAddress,
                    ))
                }
            }
        } else if self.pod_owns(client_pod, src.ip()) {
            src.ip()
        } else {
            self.counters.fallback(FallbackReason::AuthFailed);
            return Err(self.deny(
                ErrorCode::Forbidden,
                format!("{} is not an address of the calling pod", src.ip()),
            ));
        };
        Ok(Admitted {
            client_pod,
            src: SocketAddr::new(src_ip, src.port()),
        })
    }

    /// Checks a claim from `caller` for a connection it accepted on
    /// `local`: the caller is a live pod of this node that owns `local`.
    /// Returns the pod.
    pub fn admit_claim(&mut self, caller: &Caller, local: SocketAddr) -> Result<PodId, Answer> {
        let pod = self.caller_pod(caller).inspect_err(|_| {
            self.counters.fallback(FallbackReason::AuthFailed);
        })?;
        if self.pod_owns(pod, local.ip()) {
            Ok(pod)
        } else {
            self.counters.fallback(FallbackReason::AuthFailed);
            Err(self.deny(
                ErrorCode::Forbidden,
                format!("{} is not an address of the calling pod", local.ip()),
            ))
        }
    }
}
