"""Pin down which layer output is which in training-time capture."""

import torch
from transformers import LlamaForCausalLM

from difftest.fixturegen.capture import capture_states
from difftest.states import load_states


def test_layer_id_k_is_hf_hidden_states_k(tiny):
    model = LlamaForCausalLM.from_pretrained(tiny / "target").eval()
    ids = [3, 17, 42, 5, 9]
    outputs = {}
    hooks = [model.model.embed_tokens.register_forward_hook(lambda m, a, o: outputs.__setitem__(0, o[0]))]
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: outputs.__setitem__(i + 1, (o[0] if isinstance(o, tuple) else o)[0])))
    final_in = {}
    hooks.append(model.model.norm.register_forward_pre_hook(lambda m, a: final_in.__setitem__("x", a[0][0])))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    n = len(model.model.layers)
    st = capture_states(model, [ids], [0, 2, n])
    H = model.config.hidden_size
    # id 0: embedding output; id 2: output of decoder layer 1; id n: last layer, pre-norm.
    assert torch.equal(st.aux_hidden_states[:, :H], outputs[0])
    assert torch.equal(st.aux_hidden_states[:, H:2 * H], outputs[2])
    assert torch.equal(st.aux_hidden_states[:, 2 * H:], outputs[n])
    # The verifier's last state is the final norm's input, not HF's post-norm hidden_states[-1].
    assert torch.equal(st.verifier_last_hidden_states, final_in["x"])
    with torch.no_grad():
        post = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    assert not torch.allclose(post, final_in["x"])


def test_committed_states_match_their_metadata(tiny):
    st = load_states(tiny / "states.safetensors")
    assert st.aux_layer_ids == (2, 4, 5)
    assert st.aux_hidden_states.shape == (st.num_tokens, 3 * 64)


def test_trainer_subprocess_is_not_launched_as_distributed():
    # Running the SGLang engine sets torchrun's LOCAL_RANK in this process; the trainer
    # must not inherit it, or it asks for a CUDA device (the CI failure this pins).
    import os
    import subprocess
    import sys

    from difftest.engines.sglang_engine.runtime import ensure_runtime
    from difftest.fixturegen.smollm2 import single_process_env

    ensure_runtime("cpu")
    assert "LOCAL_RANK" in os.environ
    env = single_process_env()
    probe = "import speculators.train.distributed as d; d.maybe_setup_distributed(); print(d._is_distributed)"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
