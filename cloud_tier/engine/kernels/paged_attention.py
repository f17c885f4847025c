"""The CPU decode kernel's loader, under the name the engine has always imported it by: the kernels
are one extension now (see ``cloud_tier.engine.kernels``)."""

from cloud_tier.engine.kernels import load

__all__ = ["load"]
