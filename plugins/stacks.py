"""The built-in stacks, contributed through the plugin hook like any plugin's stacks."""

from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.stacks import builtin_stack_mappings


@hookimpl
def dynaspec_stacks():
    return builtin_stack_mappings()
