"""Server reflection under both `grpc.reflection.v1` and `grpc.reflection.v1alpha`.

grpcio-reflection ships only v1alpha; current grpcurl and reflection clients ask for v1 first. The two
protocols differ only in their package name (same messages, same field numbers), so the v1alpha servicer
answers v1 calls too; the v1 file descriptor is added to the pool so that reflection can describe itself.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old_prefix = f".{proto.package}."
    proto.name, proto.package = _V1_FILE, V1_PACKAGE
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old_prefix):
                field.type_name = f".{V1_PACKAGE}.{field.type_name[len(old_prefix):]}"
    for service in proto.service:
        for method in service.method:
            method.input_type = f".{V1_PACKAGE}.{method.input_type[len(old_prefix):]}"
            method.output_type = f".{V1_PACKAGE}.{method.output_type[len(old_prefix):]}"
    proto.options.Clear()
    pool.AddSerializedFile(proto.SerializeToString())


def enable_reflection(service_names: list[str], server: grpc.aio.Server) -> None:
    """Serves reflection on `server` for `service_names` plus both reflection services themselves."""
    pool = descriptor_pool.Default()
    _add_v1_descriptor(pool)
    servicer = reflection.aio.ReflectionServicer([*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME], pool=pool)
    reflection_pb2_grpc_handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    for name in (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME):
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": reflection_pb2_grpc_handler}),))
