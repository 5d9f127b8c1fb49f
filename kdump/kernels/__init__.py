"""Kernel libraries as plug-ins: the plug-in API (plugin.py: KernelPlugin, KernelSpec, Backend,
argument roles, the contract and routing views), the registry that finds plug-ins (registry.py),
what every target has without one (generic.py: the generic spec, the recorded target and the
torch reference as backends), DeepGEMM's plug-in (deepgemm/) and kdump's packaged kernel
(sm120/)."""
