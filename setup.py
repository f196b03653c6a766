"""Build hook for the optional native extension `elastic_control_plane.snapshot._snapcopy` (built from native/ into
snapshot/); all project metadata lives in pyproject.toml.

`optional=True`: without a C compiler (or zlib headers) the install still
succeeds and snapshot/copying.py falls back to its pure-Python path.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "elastic_control_plane.snapshot._snapcopy",
            ["native/snapcopy.c"],
            libraries=["z"],
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
