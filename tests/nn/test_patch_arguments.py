"""`patch` / `unpatch` refuse what is no module with a TypeError naming the argument, before anything else
(diffusers is not needed to be told)."""

import pytest

import adaln_lab


@pytest.mark.parametrize("function", ["patch", "unpatch"])
@pytest.mark.parametrize("model,kind", [("not a model", "str"), (None, "NoneType"), ({"norm_out": 1}, "dict")])
def test_a_model_that_is_no_module_is_a_type_error_naming_it(function, model, kind):
    with pytest.raises(TypeError, match=rf"^adaln_lab.{function}: model must be a torch.nn.Module \(say a diffusers "
                                        rf"MiniMaxH3Transformer3DModel\), got {kind}$"):
        getattr(adaln_lab, function)(model)
