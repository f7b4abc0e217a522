//! `flowlane status`: the node daemon's lanes and counters.

pub fn main(_args: &[String]) -> i32 {
    eprintln!("flowlane status: not implemented yet");
    1
}
