//! Flow control, kept apart from the verbs so it can be tested on its own.
//!
//! Two levels:
//! - **Link credits** (slots). The receiver owns a ring of `slots` fixed-size
//!   slots; a sender may only write into a slot the receiver has finished
//!   with, so it holds one credit per free remote slot and gets credits back
//!   in the `credits` field of any message the receiver sends. The receiver
//!   copies every message out of its slot as soon as it arrives, so link
//!   credits never wait for an application reader.
//! - **Stream windows** (bytes). Each stream's receiver buffers at most
//!   `window` bytes; the sender may only send what the window allows and gets
//!   more with a `Window` message when the reader consumes bytes. A slow
//!   reader therefore stops its own stream, never the link.
//!
//! Deadlock freedom: a sender keeps its last link credit for a message that
//! returns credits (data needs two). A message that leaves its sender with
//! fewer than two credits carries `FLAG_NEED_CREDIT`, and the receiver
//! answers it at once with its pending credits; otherwise credits go back
//! when a quarter of the ring is pending or piggy-backed on any message.

/// Link-level credit accounting for one direction pair of a link.
#[derive(Debug, Clone)]
pub struct LinkCredits {
    slots: u32,
    /// Slots of the peer's ring we may still write into.
    remote_free: u32,
    /// Our messages posted but not completed (their local send slot is busy).
    in_flight: u32,
    /// Slots of our ring we have emptied but not yet told the peer about.
    pending_return: u32,
    return_threshold: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CreditError {
    #[error("peer returned {returned} credits, which would make {total} of {slots} slots free")]
    TooMany {
        returned: u32,
        total: u64,
        slots: u32,
    },
    #[error("send completion without a message in flight")]
    NothingInFlight,
}

impl LinkCredits {
    pub fn new(slots: u32) -> Self {
        assert!(slots >= 4, "a link needs at least 4 slots");
        LinkCredits {
            slots,
            remote_free: slots,
            in_flight: 0,
            pending_return: 0,
            return_threshold: (slots / 4).max(1),
        }
    }

    /// Data and stream control messages leave one credit in reserve.
    pub fn can_send_data(&self) -> bool {
        self.remote_free >= 2 && self.in_flight < self.slots
    }

    /// A credit-only message may use the last credit, but only when it has
    /// credits to return.
    pub fn can_send_credit(&self) -> bool {
        self.remote_free >= 1 && self.in_flight < self.slots && self.pending_return > 0
    }

    /// Accounts for one posted message; returns the credits it carries back
    /// to the peer and whether it must ask for credits (`FLAG_NEED_CREDIT`).
    pub fn on_post(&mut self) -> (u32, bool) {
        debug_assert!(self.remote_free >= 1 && self.in_flight < self.slots);
        self.remote_free -= 1;
        self.in_flight += 1;
        let give = std::mem::take(&mut self.pending_return);
        (give, self.remote_free < 2)
    }

    pub fn on_send_complete(&mut self) -> Result<(), CreditError> {
        if self.in_flight == 0 {
            return Err(CreditError::NothingInFlight);
        }
        self.in_flight -= 1;
        Ok(())
    }

    /// A message was read out of our ring (its slot is free again), and it
    /// returned `returned` of our credits.
    pub fn on_receive(&mut self, returned: u32) -> Result<(), CreditError> {
        let total = self.remote_free as u64 + returned as u64;
        if total > self.slots as u64 {
            return Err(CreditError::TooMany {
                returned,
                total,
                slots: self.slots,
            });
        }
        self.remote_free = total as u32;
        self.pending_return += 1;
        Ok(())
    }

    /// Whether a credit-only message should go out now. `peer_needs` is set
    /// when the peer flagged `FLAG_NEED_CREDIT`; `idle` when nothing was sent
    /// for a while (a message we send anyway would carry them).
    pub fn should_return(&self, peer_needs: bool, idle: bool) -> bool {
        self.can_send_credit()
            && (peer_needs || idle || self.pending_return >= self.return_threshold)
    }

    pub fn remote_free(&self) -> u32 {
        self.remote_free
    }

    pub fn pending_return(&self) -> u32 {
        self.pending_return
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }
}

/// Receive-side byte accounting of one stream.
#[derive(Debug, Clone)]
pub struct RecvWindow {
    window: u64,
    /// Bytes received and not yet consumed by the reader.
    buffered: u64,
    /// Bytes consumed and not yet granted back to the sender.
    unreported: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("peer sent {len} bytes with {buffered} of a {window}-byte window already buffered")]
pub struct WindowOverrun {
    pub len: u64,
    pub buffered: u64,
    pub window: u64,
}

impl RecvWindow {
    pub fn new(window: u32) -> Self {
        RecvWindow {
            window: window as u64,
            buffered: 0,
            unreported: 0,
        }
    }

    pub fn on_data(&mut self, len: u64) -> Result<(), WindowOverrun> {
        if self.buffered + self.unreported + len > self.window {
            return Err(WindowOverrun {
                len,
                buffered: self.buffered + self.unreported,
                window: self.window,
            });
        }
        self.buffered += len;
        Ok(())
    }

    /// The reader consumed `n` bytes; returns how many bytes to grant back
    /// now (0 = wait until a quarter of the window is free, to keep window
    /// messages rare).
    pub fn on_consumed(&mut self, n: u64) -> u32 {
        debug_assert!(n <= self.buffered);
        self.buffered -= n;
        self.unreported += n;
        if self.unreported >= (self.window / 4).max(1) {
            std::mem::take(&mut self.unreported) as u32
        } else {
            0
        }
    }

    pub fn buffered(&self) -> u64 {
        self.buffered
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_keeps_the_last_credit_for_returning_credits() {
        let mut c = LinkCredits::new(4);
        for _ in 0..3 {
            assert!(c.can_send_data());
            c.on_post();
        }
        assert_eq!(c.remote_free(), 1);
        assert!(!c.can_send_data(), "last credit is reserved");
        assert!(!c.can_send_credit(), "nothing to return yet");
        c.on_receive(0).unwrap();
        assert!(c.can_send_credit());
        let (give, need) = c.on_post();
        assert_eq!((give, need), (1, true));
        assert_eq!(c.remote_free(), 0);
    }

    #[test]
    fn posting_asks_for_credit_when_fewer_than_two_remain() {
        let mut c = LinkCredits::new(4);
        assert_eq!(c.on_post(), (0, false)); // 3 left
        assert_eq!(c.on_post(), (0, false)); // 2 left
        assert_eq!(c.on_post(), (0, true)); // 1 left
    }

    #[test]
    fn returned_credits_are_bounded_by_the_ring() {
        let mut c = LinkCredits::new(8);
        c.on_post();
        c.on_post();
        c.on_receive(2).unwrap();
        assert_eq!(c.remote_free(), 8);
        assert!(matches!(c.on_receive(1), Err(CreditError::TooMany { .. })));
    }

    #[test]
    fn send_completions_free_local_slots() {
        let mut c = LinkCredits::new(4);
        assert_eq!(c.on_send_complete(), Err(CreditError::NothingInFlight));
        c.on_post();
        c.on_post();
        assert_eq!(c.in_flight(), 2);
        c.on_send_complete().unwrap();
        assert_eq!(c.in_flight(), 1);
    }

    #[test]
    fn credits_return_at_a_quarter_of_the_ring_or_on_request() {
        let mut c = LinkCredits::new(16);
        for _ in 0..3 {
            c.on_receive(0).unwrap();
        }
        assert!(!c.should_return(false, false));
        assert!(c.should_return(true, false), "peer asked");
        assert!(c.should_return(false, true), "idle flush");
        c.on_receive(0).unwrap();
        assert!(c.should_return(false, false), "4 of 16 pending");
        assert_eq!(c.on_post().0, 4, "a message carries all pending credits");
        assert_eq!(c.pending_return(), 0);
    }

    /// Two endpoints exchanging messages through the credit rules, with
    /// random choices of who sends what, never overrun a ring and never get
    /// stuck: every state has a move that makes progress.
    #[test]
    fn simulated_links_never_overrun_or_deadlock() {
        struct End {
            c: LinkCredits,
            want: u32, // data messages still to send
        }
        let slots = 6;
        let mut seed = 0x1234_5678_u64;
        let mut rnd = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for round in 0..200 {
            let mut e = [
                End {
                    c: LinkCredits::new(slots),
                    want: 50 + round,
                },
                End {
                    c: LinkCredits::new(slots),
                    want: 30,
                },
            ];
            // messages in flight from i to 1-i: (credits carried, need flag)
            let mut wire: [Vec<(u32, bool)>; 2] = [vec![], vec![]];
            let mut need = [false, false];
            let mut steps = 0;
            while e[0].want + e[1].want > 0 || !wire[0].is_empty() || !wire[1].is_empty() {
                steps += 1;
                assert!(steps < 100_000, "no progress (round {round})");
                let i = rnd(2) as usize;
                match rnd(3) {
                    0 if e[i].want > 0 && e[i].c.can_send_data() => {
                        let m = e[i].c.on_post();
                        e[i].c.on_send_complete().unwrap();
                        wire[i].push(m);
                        assert!(wire[i].len() <= slots as usize, "ring overrun");
                        e[i].want -= 1;
                    }
                    1 if !wire[1 - i].is_empty() => {
                        // i reads one message sent to it
                        let (credits, flag) = wire[1 - i].remove(0);
                        e[i].c.on_receive(credits).unwrap();
                        need[i] |= flag;
                    }
                    _ => {
                        if e[i].c.should_return(need[i], false) {
                            need[i] = false;
                            let m = e[i].c.on_post();
                            e[i].c.on_send_complete().unwrap();
                            wire[i].push(m);
                            assert!(wire[i].len() <= slots as usize, "ring overrun");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn stream_window_grants_back_in_quarters_and_refuses_overruns() {
        let mut w = RecvWindow::new(1000);
        w.on_data(600).unwrap();
        w.on_data(400).unwrap();
        assert!(matches!(w.on_data(1), Err(WindowOverrun { .. })));
        assert_eq!(w.on_consumed(100), 0);
        assert_eq!(w.on_consumed(150), 250);
        assert_eq!(w.buffered(), 750);
        // Granted bytes may be sent again; unreported ones may not.
        w.on_data(250).unwrap();
        assert!(w.on_data(1).is_err());
    }
}
