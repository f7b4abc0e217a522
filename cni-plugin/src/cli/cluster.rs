//! `flowlane cluster up|down|status`: a local training cluster on this machine.

pub fn main(_args: &[String]) -> i32 {
    eprintln!("flowlane cluster: not implemented yet");
    1
}
