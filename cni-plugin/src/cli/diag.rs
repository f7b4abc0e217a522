//! `flowlane diag`: check this node and explain every problem.

pub fn main(_args: &[String]) -> i32 {
    eprintln!("flowlane diag: not implemented yet");
    1
}
