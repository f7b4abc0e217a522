//! Harness for flowlane's end-to-end tests: network namespaces, the real
//! binaries, and third-party programs.
