//! Waits for something a pod does that no wake-up announces (it maps its
//! channel, it attaches to its region): look often at first, when it
//! usually happens (microseconds after the answer that prompts it), then
//! less and less often, so that a long wait costs few looks.

use std::time::{Duration, Instant};

/// The first pause between two looks.
const FIRST: Duration = Duration::from_micros(50);
/// The longest pause between two looks.
const LONGEST: Duration = Duration::from_millis(2);

/// The pauses between looks: 50 µs, 100 µs, 200 µs, ... then 2 ms each.
fn pauses() -> impl Iterator<Item = Duration> {
    std::iter::successors(Some(FIRST), |p| Some((*p * 2).min(LONGEST)))
}

/// Calls `look` until it answers `Some` or `deadline` passes (`None`),
/// pausing between looks as [`pauses`] says.
pub(super) fn until<T>(deadline: Instant, mut look: impl FnMut() -> Option<T>) -> Option<T> {
    let mut pauses = pauses();
    loop {
        if let Some(v) = look() {
            return Some(v);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        let pause = pauses.next().unwrap_or(LONGEST);
        std::thread::sleep(pause.min(deadline - now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_from_50_us_up_to_2_ms() {
        let us: Vec<u128> = pauses().take(9).map(|p| p.as_micros()).collect();
        assert_eq!(us, [50, 100, 200, 400, 800, 1600, 2000, 2000, 2000]);
    }

    #[test]
    fn looks_until_an_answer_or_the_deadline() {
        let mut looks = 0;
        let got = until(Instant::now() + Duration::from_secs(60), || {
            looks += 1;
            (looks == 3).then_some(looks)
        });
        assert_eq!(got, Some(3));
        let t0 = Instant::now();
        let none: Option<()> = until(t0 + Duration::from_millis(5), || None);
        assert_eq!(none, None);
        assert!(t0.elapsed() >= Duration::from_millis(5), "gave up early");
    }
}
