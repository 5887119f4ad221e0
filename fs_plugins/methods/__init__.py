"""One module per method. Each defines a `Method` subclass registered by name."""
from fs_plugins.methods.base import ClientUpdate, Method, Phase  # noqa: F401
from fs_plugins.methods.registry import all_methods, get_method_class, register_method  # noqa: F401
