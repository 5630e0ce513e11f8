"""The DSv4 network (spec §2-§13): config, model, checkpoint conversion, hybrid patterns."""
from dsv4.model.config import ConfigError, DSv4Config, get_config
from dsv4.model.interop import from_hf, load_official, save_official, to_hf
from dsv4.model.hybrid import count_params, parse_pattern
from dsv4.model.model import DSv4Model, DSv4Output, build_model
from dsv4.model.precision import cast_model

__all__ = ["ConfigError", "DSv4Config", "get_config", "DSv4Model", "DSv4Output", "build_model", "from_hf",
           "to_hf", "load_official", "save_official", "count_params", "parse_pattern", "cast_model"]
