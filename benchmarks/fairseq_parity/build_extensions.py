"""Builds the two Cython extensions fairseq's language-modeling path needs, in place (run from fairseq's source)."""

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        "fairseq.data.data_utils_fast",
        ["fairseq/data/data_utils_fast.pyx"],
        language="c++",
        include_dirs=[numpy.get_include()],
    ),
    Extension(
        "fairseq.data.token_block_utils_fast",
        ["fairseq/data/token_block_utils_fast.pyx"],
        include_dirs=[numpy.get_include()],
    ),
]
setup(
    name="fairseq-extensions",
    ext_modules=cythonize(extensions, language_level=3, quiet=True),
    script_args=["build_ext", "--inplace", "-q"],
)
