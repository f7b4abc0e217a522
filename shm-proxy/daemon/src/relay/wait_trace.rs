//! Where a zero-copy relayed direction spends its time: one summary line
//! per connection and direction when it ends (`relay: zero-copy sender
//! waits` / `receiver`), so a slow stream on a real rig can be explained
//! (waiting for the pod's data, for the NIC's completions, for the remote
//! ring's room) without a debugger. Counting costs two clock reads per
//! wait, which is a sleep anyway.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// What the sending pump was short of when it went to sleep.
#[derive(Clone, Copy)]
pub(super) enum Want {
    /// The pod had published nothing new.
    Data,
    /// Everything was placed; its completion (the pod's ring room) pending.
    Completion,
    /// Bytes to place, but the remote ring was full (no ROOM yet).
    Room,
}

#[derive(Default)]
struct Tally {
    n: u64,
    total: Duration,
    max: Duration,
    /// Waits that ran the whole slice: nobody woke us (a timeout rescued
    /// the wait, or nothing happened for that long).
    slices: u64,
}

impl Tally {
    fn add(&mut self, d: Duration, slice: Duration) {
        self.n += 1;
        self.total += d;
        self.max = self.max.max(d);
        if d >= slice.mul_f32(0.9) {
            self.slices += 1;
        }
    }

    fn show(&self) -> String {
        format!(
            "{}x {:.1}ms (max {:.1}ms, {} full slices)",
            self.n,
            self.total.as_secs_f64() * 1e3,
            self.max.as_secs_f64() * 1e3,
            self.slices
        )
    }
}

/// The sending pump's record.
pub(super) struct SenderTrace {
    start: Instant,
    slice: Duration,
    data: Tally,
    completion: Tally,
    room: Tally,
    places: u64,
    bytes: u64,
    /// (stream end position of a placement, when it was posted).
    inflight: VecDeque<(u64, Instant)>,
    completed: Tally,
    max_inflight: u64,
}

impl SenderTrace {
    pub(super) fn new(slice_ms: u32) -> SenderTrace {
        SenderTrace {
            start: Instant::now(),
            slice: Duration::from_millis(slice_ms as u64),
            data: Tally::default(),
            completion: Tally::default(),
            room: Tally::default(),
            places: 0,
            bytes: 0,
            inflight: VecDeque::new(),
            completed: Tally::default(),
            max_inflight: 0,
        }
    }

    pub(super) fn placed(&mut self, end: u64, len: usize, in_flight: u64) {
        self.places += 1;
        self.bytes += len as u64;
        self.inflight.push_back((end, Instant::now()));
        self.max_inflight = self.max_inflight.max(in_flight);
    }

    /// The NIC completed up to stream position `done`.
    pub(super) fn completed(&mut self, done: u64) {
        while let Some(&(end, at)) = self.inflight.front() {
            if end > done {
                break;
            }
            self.completed.add(at.elapsed(), Duration::MAX);
            self.inflight.pop_front();
        }
    }

    pub(super) fn waited(&mut self, want: Want, since: Instant) {
        let d = since.elapsed();
        let t = match want {
            Want::Data => &mut self.data,
            Want::Completion => &mut self.completion,
            Want::Room => &mut self.room,
        };
        t.add(d, self.slice);
    }

    pub(super) fn log(&self, id: u64) {
        tracing::info!(
            id,
            secs = format!("{:.2}", self.start.elapsed().as_secs_f64()),
            bytes = self.bytes,
            places = self.places,
            max_in_flight = self.max_inflight,
            completion_latency = self.completed.show(),
            wait_data = self.data.show(),
            wait_completion = self.completion.show(),
            wait_room = self.room.show(),
            "relay: zero-copy sender waits"
        );
    }
}

/// The receiving side's record (the room reporter and PLACED handling).
pub(super) struct ReceiverTrace {
    slice: Duration,
    pub(super) rooms: u64,
    waits: Tally,
}

impl ReceiverTrace {
    pub(super) fn new(slice_ms: u32) -> ReceiverTrace {
        ReceiverTrace {
            slice: Duration::from_millis(slice_ms as u64),
            rooms: 0,
            waits: Tally::default(),
        }
    }

    pub(super) fn waited(&mut self, since: Instant) {
        let d = since.elapsed();
        self.waits.add(d, self.slice);
    }

    pub(super) fn log(&self, id: u64, placed: u64, wakes: u64) {
        tracing::info!(
            id,
            placed,
            placed_doorbells = wakes,
            rooms = self.rooms,
            room_waits = self.waits.show(),
            "relay: zero-copy receiver"
        );
    }
}
