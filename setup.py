"""Builds the optional C disk reader (csrc/pread_pool.c, slab_plan.c, aio_reader.c -> engram.store._pread_pool).

The extension is optional: when no compiler is present the build goes on without it and the disk tier
falls back to its pure-Python reader (it warns once at first use).
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "engram.store._pread_pool",
            sources=["csrc/pread_pool.c", "csrc/slab_plan.c", "csrc/aio_reader.c", "csrc/decode_reads.c"],
            depends=["csrc/crc32c.h", "csrc/read_call.h"],
            extra_compile_args=["-O2", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
