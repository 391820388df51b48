"""Callables a user would hand to `python -m adaln_lab report --candidate tests.harness.user_kernels:NAME`."""

from adaln_lab.reference import replay

NOT_CALLABLE = 3


def replay_kernel(x, norm_weight, temb, weight, bias, timestep_indices):
    """A correct, batch-invariant candidate: the op-for-op replay."""
    return replay(x, norm_weight, temb, weight, bias, timestep_indices)


def returns_a_tuple(x, norm_weight, temb, weight, bias, timestep_indices):
    """A wrong candidate: the output and a second value, as a kernel returning its saved rstd would."""
    return replay(x, norm_weight, temb, weight, bias, timestep_indices), None


class Kernels:
    @staticmethod
    def leaky(x, norm_weight, temb, weight, bias, timestep_indices):
        """A planted leak: every row sees the batch mean."""
        return replay(x, norm_weight, temb, weight, bias, timestep_indices) + 2.0 ** -4 * x.mean(dim=0, keepdim=True)
