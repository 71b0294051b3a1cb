"""``tf.train.Example`` into numpy, without TensorFlow: ``parse_example``.

The message types (``Example``, ``Features``, ``Feature``, ``BytesList``, ``FloatList``,
``Int64List``) are declared here at run time with the ``protobuf`` package's
``descriptor_pb2``, field for field as TensorFlow's ``example.proto`` and ``feature.proto``
define them (same numbers, types and packing), in a descriptor pool of their own, so that
they never clash with TensorFlow's if both are imported. The wire format depends only on
the field numbers and types, so these classes parse what ``tf.io.TFRecordWriter`` wrote.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

_PACKAGE = "tensorflow"
_FILE = "procpipe/readers/tf_example.proto"


@functools.lru_cache(maxsize=1)
def example_class() -> Any:
    """The ``tensorflow.Example`` message class (built once per process)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name=_FILE, package=_PACKAGE, syntax="proto3")

    def message(name: str, fields: list[tuple[str, int, int, int, str | None, bool]], parent: Any = None) -> Any:
        msg = (parent.nested_type if parent is not None else proto.message_type).add(name=name)
        for field_name, number, label, kind, type_name, packed in fields:
            field = msg.field.add(name=field_name, number=number, label=label, type=kind)
            if type_name:
                field.type_name = type_name
            if packed:
                field.options.packed = True
        return msg

    repeated, optional = F.LABEL_REPEATED, F.LABEL_OPTIONAL
    message("BytesList", [("value", 1, repeated, F.TYPE_BYTES, None, False)])
    message("FloatList", [("value", 1, repeated, F.TYPE_FLOAT, None, True)])
    message("Int64List", [("value", 1, repeated, F.TYPE_INT64, None, True)])
    feature = message(
        "Feature",
        [
            ("bytes_list", 1, optional, F.TYPE_MESSAGE, f".{_PACKAGE}.BytesList", False),
            ("float_list", 2, optional, F.TYPE_MESSAGE, f".{_PACKAGE}.FloatList", False),
            ("int64_list", 3, optional, F.TYPE_MESSAGE, f".{_PACKAGE}.Int64List", False),
        ],
    )
    feature.oneof_decl.add(name="kind")
    for field in feature.field:
        field.oneof_index = 0
    features = message(
        "Features", [("feature", 1, repeated, F.TYPE_MESSAGE, f".{_PACKAGE}.Features.FeatureEntry", False)]
    )
    entry = message(
        "FeatureEntry",
        [
            ("key", 1, optional, F.TYPE_STRING, None, False),
            ("value", 2, optional, F.TYPE_MESSAGE, f".{_PACKAGE}.Feature", False),
        ],
        parent=features,
    )
    entry.options.map_entry = True
    message("Example", [("features", 1, optional, F.TYPE_MESSAGE, f".{_PACKAGE}.Features", False)])

    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.Example"))


def parse_example(record: bytes) -> dict[str, Any]:
    """One serialized ``tf.train.Example`` as ``{feature name: value}``.

    ``int64_list`` becomes an ``int64`` array, ``float_list`` a ``float32`` array (always 1-D,
    as in the proto: reshape in ``fn``), ``bytes_list`` a list of ``bytes``; a feature with
    no kind set becomes an empty ``float32`` array. Raises ``ValueError`` if ``record`` is
    not a valid ``Example``.
    """
    example = example_class()()
    try:
        example.ParseFromString(record)
    except Exception as exc:
        raise ValueError(f"not a serialized tf.train.Example ({len(record)} bytes): {exc}") from exc
    out: dict[str, Any] = {}
    for name, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        if kind == "int64_list":
            out[name] = np.array(feature.int64_list.value, dtype=np.int64)
        elif kind == "float_list":
            out[name] = np.array(feature.float_list.value, dtype=np.float32)
        elif kind == "bytes_list":
            out[name] = list(feature.bytes_list.value)
        else:
            out[name] = np.empty(0, np.float32)
    return out


def make_example(features: dict[str, Any]) -> bytes:
    """``{name: values}`` serialized as a ``tf.train.Example`` (for tests and for writing
    small files without TensorFlow): ``bytes`` / lists of ``bytes`` go in a ``bytes_list``,
    integer arrays in an ``int64_list``, the rest in a ``float_list``."""
    example = example_class()()
    for name, value in features.items():
        feature = example.features.feature[name]
        if isinstance(value, bytes):
            feature.bytes_list.value.append(value)
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            feature.bytes_list.value.extend(value)
        else:
            array = np.asarray(value).ravel()
            if array.dtype.kind in "iub":
                feature.int64_list.value.extend(array.astype(np.int64).tolist())
            else:
                feature.float_list.value.extend(array.astype(np.float32).tolist())
    return example.SerializeToString()
