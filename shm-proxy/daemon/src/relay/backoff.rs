//! Waits for something a pod does that no wake-up announces (it maps its
//! channel, it attaches to its region): look often at first, when it
//! usually happens (microseconds after the answer that prompts it), then
//! less and less often, so that a long wait costs few looks.

use std::time::{Duration, Instant};

/// The first pause between two looks.
const FIRST: Duration = Duration::from_micros(50);
/// The longest pause between two looks.
const LONGEST: Duration = Duration::from_millis(2);

/// Calls `look` until it answers `Some` or `deadline` passes (`None`),
/// pausing 50 µs, 100 µs, 200 µs, ... at most 2 ms between looks.
pub(super) fn until<T>(deadline: Instant, mut look: impl FnMut() -> Option<T>) -> Option<T> {
    let mut pause = FIRST;
    loop {
        if let Some(v) = look() {
            return Some(v);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(LONGEST);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn looks_often_first_then_less_often_and_stops_at_the_deadline() {
        let t0 = Instant::now();
        let mut looks = 0;
        let got = until(t0 + Duration::from_millis(30), || {
            looks += 1;
            (looks == 3).then_some(looks)
        });
        assert_eq!(got, Some(3));
        let mut looks = 0;
        let none: Option<()> = until(Instant::now() + Duration::from_millis(30), || {
            looks += 1;
            None
        });
        assert_eq!(none, None);
        // 50 + 100 + ... + 1600 µs is 3.15 ms, then 2 ms pauses: about 20
        // looks in 30 ms, not hundreds, and more than the 15 of 2 ms pauses.
        assert!((10..=40).contains(&looks), "{looks} looks");
    }
}
