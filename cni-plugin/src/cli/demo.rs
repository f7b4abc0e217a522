//! `flowlane demo`: the training-traffic demo and its report.

pub fn main(_args: &[String]) -> i32 {
    eprintln!("flowlane demo: not implemented yet");
    1
}
