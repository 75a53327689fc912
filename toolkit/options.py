"""``toolkit.options``: a fairseq name users import (``from toolkit import options``); the parsers live
in :mod:`toolkit.config.options`. A top-level API facade: library code imports the layered module."""
from toolkit.config.options import (  # noqa: F401
    OneLineErrorParser,
    add_dataclass_options,
    architecture_defaults,
    args_to_dict,
    build_parser,
    config_from_args,
    explicit_options,
    flag_name,
    given_options,
    parse_with_components,
)
