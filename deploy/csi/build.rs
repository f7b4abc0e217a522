//! Compiles the two vendored protocols (`proto/`) into tonic services and clients:
//! the CSI spec (Identity, Node) and the kubelet's plugin registration. protox is a
//! pure-Rust protobuf compiler that carries the well-known types csi.proto imports,
//! so the build needs no protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/csi.proto", "proto/pluginregistration.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        // Services the plugin does not serve (Controller, GroupController,
        // SnapshotMetadata, the Node RPCs it does not advertise) answer
        // UNIMPLEMENTED, as the spec asks.
        .generate_default_stubs(true)
        // The specs' comments are prose with indented blocks rustdoc would run
        // as doctests; the vendored .proto files are the reference.
        .disable_comments(["."])
        .compile_fds(fds)?;
    Ok(())
}
