#!/usr/bin/python3
"""Minimal CRI (runtime.v1) client for flowlane's end-to-end tests.

Calls one method of containerd's CRI plugin over its unix socket, the way
the kubelet does, and prints the response as JSON (proto field names).

  cri_client.py SOCKET METHOD [REQUEST_JSON]

METHOD is a RuntimeService or ImageService method name (RunPodSandbox,
StopPodSandbox, ExecSync, ...); REQUEST_JSON is the request message in
protobuf JSON form (defaults to {}). ExecSync's stdout/stderr are printed as
text rather than base64.

Needs Debian's python3-grpcio and python3-protobuf (hence /usr/bin/python3),
and `api_pb2.py`, generated at test time from api.proto (next to this file)
with `protoc --python_out=DIR`; CRI_PB_DIR names that directory. Exit status:
0 on success, 2 on a gRPC error (status code and details on stderr).
"""
import json
import os
import sys

import grpc
from google.protobuf import json_format

sys.path.insert(0, os.environ.get("CRI_PB_DIR", os.path.dirname(os.path.abspath(__file__))))
import api_pb2 as pb  # noqa: E402

IMAGE_METHODS = {"ListImages", "ImageStatus", "PullImage", "RemoveImage", "ImageFsInfo"}


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 64
    sock, method = argv[1], argv[2]
    request_json = argv[3] if len(argv) > 3 else "{}"
    service = "ImageService" if method in IMAGE_METHODS else "RuntimeService"
    req_cls = getattr(pb, method + "Request")
    resp_cls = getattr(pb, method + "Response")
    request = json_format.Parse(request_json, req_cls())
    channel = grpc.insecure_channel("unix://" + sock)
    call = channel.unary_unary(
        f"/runtime.v1.{service}/{method}",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=resp_cls.FromString,
    )
    timeout = float(os.environ.get("CRI_TIMEOUT", "90"))
    try:
        response = call(request, timeout=timeout)
    except grpc.RpcError as e:
        print(f"{method}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    if method == "ExecSync":
        out = {
            "exit_code": response.exit_code,
            "stdout": response.stdout.decode("utf-8", "replace"),
            "stderr": response.stderr.decode("utf-8", "replace"),
        }
    else:
        out = json_format.MessageToDict(response, preserving_proto_field_name=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
