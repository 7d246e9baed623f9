"""The Transformers releases `rla_lib.align` supports, and where their Qwen2/Qwen3 modeling code differs.

`align` rewrites stock forwards of the Qwen2/Qwen3 modeling code (and relies on others, see the guard in
`rla_lib.align`). It supports the series the large RL stacks pin: 4.57, 5.10 (verl 0.9 pins `transformers<5.11`)
and 5.19 (vLLM 0.32's). Each series has the SHA-256 of every such function's source as in the release it was
verified on; another patch release of a supported series is accepted when its sources hash the same. The align
tests run under each (`make test-transformers`: 4.57 and 5.10 in environments of their own).

What differs between the series, as far as `align` is concerned (diffs of the hashed functions):

- 4.57 → 5.x, the attention forward: 4.57 takes `cache_position`, hands `{"sin", "cos", "cache_position"}` to
  `past_key_values.update` (a static cache writes at `cache_position`), and looks the attention function up as
  `ALL_ATTENTION_FUNCTIONS[implementation]` unless it is "eager" (5.x: `ALL_ATTENTION_FUNCTIONS.get_interface`).
  Its decoder layer passes `cache_position` on by name (the aligned one in `**kwargs`); both forwards carry a
  `past_key_value` → `past_key_values` renaming decorator, which the aligned ones do not (the model passes the new
  name). The rotary embedding reads its type from `config.rope_scaling` and keeps its init function as
  `rope_init_fn`; its cos/sin come from an FP32 matmul of frequencies and positions (5.19: an elementwise
  product; one term, the same FP32 values). Eager attention and SDPA slice a 4D mask to the key length (a no-op
  on the masks its `masking_utils` builds) and eager attention needs the mask 4D. Output capturing
  (`output_attentions`, `output_hidden_states`) leaves each captured module's class forward bound on the
  instance, which `align` takes for stock.
- 5.10 → 5.19: nothing in the rewritten forwards. Changed in what `align` calls as it is: the rotary
  embedding (5.10 still uses the matmul), `apply_rotary_pos_emb`'s hub-kernel decorator, `sdpa_attention_forward`
  (5.19 adds the paged cache and the position bias) and the masks' SDPA skip rules."""

from __future__ import annotations

from dataclasses import dataclass

import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


@dataclass(frozen=True)
class Release:
    """One supported Transformers series: the release its sources were verified on and its modeling API."""

    verified: str
    api: int  # 4: the 4.x attention forward (cache_position, cache_kwargs, attention looked up by key); 5: 5.x
    sha256: dict[str, str]

    def attention_function(self, module, eager):
        """The attention function the stock attention forward picks for the model's `attn_implementation`."""
        implementation = module.config._attn_implementation
        if self.api == 4:
            return eager if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation]
        return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)

    def cache_update_args(self, cos, sin, kwargs: dict) -> tuple:
        """The extra arguments of the stock forward's `past_key_values.update`. On 4.x, takes `cache_position` out
        of `kwargs` (a named argument of the stock forward, so the attention function never sees it)."""
        if self.api == 4:
            return ({"sin": sin, "cos": cos, "cache_position": kwargs.pop("cache_position", None)},)
        return ()

    def rope_init_function(self, rotary):
        """The function the stock `RotaryEmbedding.__init__` computes `inv_freq` with."""
        if self.api == 4:
            return rotary.rope_init_fn
        if rotary.rope_type == "default":
            return rotary.compute_default_rope_parameters
        return ROPE_INIT_FUNCTIONS[rotary.rope_type]


# Per series, oldest first: the SHA-256 of the stock source (`inspect.getsource`) of each function `align` rewrites
# or relies on; "masking_utils" and "sdpa_attention": the masks the attention region reads (SDPA's None stands for
# `is_causal`).
RELEASES = {
    "4.57": Release("4.57.6", api=4, sha256={
        "qwen2.Qwen2RMSNorm.forward": "790fa612e4fa57acfcbea31da45f92ba91f9016f7260ef539f61c5530ba06a5f",
        "qwen2.Qwen2MLP.forward": "03df2d7685cf8446594448cbd33ef676a2b088779d99d9803abe3bed2ec7ad9b",
        "qwen2.Qwen2Attention.forward": "3941d215a5019d1d5a6012dfe450e9799f292bfb518708f0ce673af928c148d6",
        "qwen2.Qwen2DecoderLayer.forward": "b6c3de007004e0f30aca7e6e4a2fceefbc4eb13c41b87ff6c830e8ea85b71d0f",
        "qwen2.Qwen2RotaryEmbedding.__init__": "79d0d6136ea5a41db3526076e41043f2ce8584e2087c4d26263d6bb2c3e6623f",
        "qwen2.Qwen2RotaryEmbedding.forward": "f624a9f38bce5eb882ffc9fd1683268714a902ffa39a615de360fa589a7d6b26",
        "qwen2.Qwen2Model.forward": "c7042210d64db0e7957eada506301a43a3a6d0fdd4cd625f06fb93855c7d8ff0",
        "qwen2.apply_rotary_pos_emb": "d1e7d21b55bc5ca988047b17ea15ac7d674428b30073c3e101eb782180a58a25",
        "qwen2.rotate_half": "f714a4b1160c694e270d9191a9f133e53856e2a1c62f5cd2f85740f7c2692397",
        "qwen2.eager_attention_forward": "8dd801c3a8d26a45507f388d43f47ff8640dd51c4ee3f9c71b3efc87a668788c",
        "qwen2.repeat_kv": "e9b1ad4a8df3194d5b12f94567c3a2dfed2c0d9833af1b8f775e5875575ff9c4",
        "qwen3.Qwen3RMSNorm.forward": "790fa612e4fa57acfcbea31da45f92ba91f9016f7260ef539f61c5530ba06a5f",
        "qwen3.Qwen3MLP.forward": "03df2d7685cf8446594448cbd33ef676a2b088779d99d9803abe3bed2ec7ad9b",
        "qwen3.Qwen3Attention.forward": "b7f578b05d078191a15bfc1a3728b202ac85b981a2539ed1a05243c68cfbffae",
        "qwen3.Qwen3DecoderLayer.forward": "b6c3de007004e0f30aca7e6e4a2fceefbc4eb13c41b87ff6c830e8ea85b71d0f",
        "qwen3.Qwen3RotaryEmbedding.__init__": "b3b2e83b1f82274064b7147c2cbb2a3b620578ccc448d2d0bdec8775c4efe56b",
        "qwen3.Qwen3RotaryEmbedding.forward": "f624a9f38bce5eb882ffc9fd1683268714a902ffa39a615de360fa589a7d6b26",
        "qwen3.Qwen3Model.forward": "c7042210d64db0e7957eada506301a43a3a6d0fdd4cd625f06fb93855c7d8ff0",
        "qwen3.apply_rotary_pos_emb": "d1e7d21b55bc5ca988047b17ea15ac7d674428b30073c3e101eb782180a58a25",
        "qwen3.rotate_half": "f714a4b1160c694e270d9191a9f133e53856e2a1c62f5cd2f85740f7c2692397",
        "qwen3.eager_attention_forward": "8dd801c3a8d26a45507f388d43f47ff8640dd51c4ee3f9c71b3efc87a668788c",
        "qwen3.repeat_kv": "e9b1ad4a8df3194d5b12f94567c3a2dfed2c0d9833af1b8f775e5875575ff9c4",
        "masking_utils.eager_mask": "e1c62c159779980debdea23f6b77e0600319983f2d15fdc98a18122f3599c70e",
        "masking_utils._ignore_causal_mask_sdpa": "0eb638a5f3fe9bd22dcd34f0468254aab31190635bb39342e0bb0a2ba4db36f6",
        "sdpa_attention.sdpa_attention_forward": "1552320f53db8dcb5ca6364eb2ae2bba23552e6c3171d6eadc9970663ca5d5b6",
    }),
    "5.10": Release("5.10.4", api=5, sha256={
        "qwen2.Qwen2RMSNorm.forward": "790fa612e4fa57acfcbea31da45f92ba91f9016f7260ef539f61c5530ba06a5f",
        "qwen2.Qwen2MLP.forward": "03df2d7685cf8446594448cbd33ef676a2b088779d99d9803abe3bed2ec7ad9b",
        "qwen2.Qwen2Attention.forward": "3d7ae1485294d0c8d57827617a3abed805bcf0c4107ead3d1a47f67eee7dcb1b",
        "qwen2.Qwen2DecoderLayer.forward": "75d1d62e173e8c574b8a61338d1fa5052774d13b848eecd282cde88cd6690b8e",
        "qwen2.Qwen2RotaryEmbedding.__init__": "bac53a4b8a82e8eb1ae64d420ccffef5ad868a8e88456ea5f111c4fbdee92227",
        "qwen2.Qwen2RotaryEmbedding.forward": "48af9cb5114a19abc14aa7cbdf0eb82bde6a207a3a2cb5cad9fd10146df7f7c6",
        "qwen2.Qwen2Model.forward": "523115d50c78f82f5256cc0aa9cba43732f8f6b92bef4831382a07c570c2b076",
        "qwen2.apply_rotary_pos_emb": "e2975ea7060de67704dfef2f64c821064e66fc292923e37f1d2689077e846b94",
        "qwen2.rotate_half": "f714a4b1160c694e270d9191a9f133e53856e2a1c62f5cd2f85740f7c2692397",
        "qwen2.eager_attention_forward": "cb34ccea28710ae8d5d94a241b704ea3d974048f85372f0b1b3c2a8a2ef1ee20",
        "qwen2.repeat_kv": "e9b1ad4a8df3194d5b12f94567c3a2dfed2c0d9833af1b8f775e5875575ff9c4",
        "qwen3.Qwen3RMSNorm.forward": "790fa612e4fa57acfcbea31da45f92ba91f9016f7260ef539f61c5530ba06a5f",
        "qwen3.Qwen3MLP.forward": "03df2d7685cf8446594448cbd33ef676a2b088779d99d9803abe3bed2ec7ad9b",
        "qwen3.Qwen3Attention.forward": "6c8fb032ff3742438fb80dab4427c11ef04e12fdc02f08abd11ff5adaa0fd1c3",
        "qwen3.Qwen3DecoderLayer.forward": "75d1d62e173e8c574b8a61338d1fa5052774d13b848eecd282cde88cd6690b8e",
        "qwen3.Qwen3RotaryEmbedding.__init__": "9b9c635d576c91194bc6ef65b4e12fd8da228a419ab71589a81dc2cad92262e3",
        "qwen3.Qwen3RotaryEmbedding.forward": "48af9cb5114a19abc14aa7cbdf0eb82bde6a207a3a2cb5cad9fd10146df7f7c6",
        "qwen3.Qwen3Model.forward": "523115d50c78f82f5256cc0aa9cba43732f8f6b92bef4831382a07c570c2b076",
        "qwen3.apply_rotary_pos_emb": "e2975ea7060de67704dfef2f64c821064e66fc292923e37f1d2689077e846b94",
        "qwen3.rotate_half": "f714a4b1160c694e270d9191a9f133e53856e2a1c62f5cd2f85740f7c2692397",
        "qwen3.eager_attention_forward": "cb34ccea28710ae8d5d94a241b704ea3d974048f85372f0b1b3c2a8a2ef1ee20",
        "qwen3.repeat_kv": "e9b1ad4a8df3194d5b12f94567c3a2dfed2c0d9833af1b8f775e5875575ff9c4",
        "masking_utils.eager_mask": "3065c7dfbdac67178ac5fcda16c4095b1c2077ff394bd58365c19778ab93d774",
        "masking_utils._ignore_causal_mask_sdpa": "99bd967318b2212b0acf3b97423bce3e739268e210630cdc2779a575778bf711",
        "sdpa_attention.sdpa_attention_forward": "9123c5d5d025ecb29cd9c39cbf646627ab0eae85acd69d43ff275f0edbb914b6",
    }),
    "5.19": Release("5.19.0", api=5, sha256={
        "qwen2.Qwen2RMSNorm.forward": "790fa612e4fa57acfcbea31da45f92ba91f9016f7260ef539f61c5530ba06a5f",
        "qwen2.Qwen2MLP.forward": "03df2d7685cf8446594448cbd33ef676a2b088779d99d9803abe3bed2ec7ad9b",
        "qwen2.Qwen2Attention.forward": "3d7ae1485294d0c8d57827617a3abed805bcf0c4107ead3d1a47f67eee7dcb1b",
        "qwen2.Qwen2DecoderLayer.forward": "75d1d62e173e8c574b8a61338d1fa5052774d13b848eecd282cde88cd6690b8e",
        "qwen2.Qwen2RotaryEmbedding.__init__": "89238533478af2fc6c042072ef208f1974df8d6a6c39f0c8bb4bd73ebc65897a",
        "qwen2.Qwen2RotaryEmbedding.forward": "d5289777a85ea890f1c715511474f81f73c06b29d3d0792a37d8ad7347683445",
        "qwen2.Qwen2Model.forward": "523115d50c78f82f5256cc0aa9cba43732f8f6b92bef4831382a07c570c2b076",
        "qwen2.apply_rotary_pos_emb": "ea234325c15de475147027ac7da4307167d082b13f4c62a7f2921fef4f9e5e87",
        "qwen2.rotate_half": "f714a4b1160c694e270d9191a9f133e53856e2a1c62f5cd2f85740f7c2692397",
        "qwen2.eager_attention_forward": "cb34ccea28710ae8d5d94a241b704ea3d974048f85372f0b1b3c2a8a2ef1ee20",
        "qwen2.repeat_kv": "e9b1ad4a8df3194d5b12f94567c3a2dfed2c0d9833af1b8f775e5875575ff9c4",
        "qwen3.Qwen3RMSNorm.forward": "790fa612e4fa57acfcbea31da45f92ba91f9016f7260ef539f61c5530ba06a5f",
        "qwen3.Qwen3MLP.forward": "03df2d7685cf8446594448cbd33ef676a2b088779d99d9803abe3bed2ec7ad9b",
        "qwen3.Qwen3Attention.forward": "6c8fb032ff3742438fb80dab4427c11ef04e12fdc02f08abd11ff5adaa0fd1c3",
        "qwen3.Qwen3DecoderLayer.forward": "75d1d62e173e8c574b8a61338d1fa5052774d13b848eecd282cde88cd6690b8e",
        "qwen3.Qwen3RotaryEmbedding.__init__": "5341c807741d21e1be23740fedb818381e775f52e9774f4ab7e76d3fda308eab",
        "qwen3.Qwen3RotaryEmbedding.forward": "d5289777a85ea890f1c715511474f81f73c06b29d3d0792a37d8ad7347683445",
        "qwen3.Qwen3Model.forward": "523115d50c78f82f5256cc0aa9cba43732f8f6b92bef4831382a07c570c2b076",
        "qwen3.apply_rotary_pos_emb": "ea234325c15de475147027ac7da4307167d082b13f4c62a7f2921fef4f9e5e87",
        "qwen3.rotate_half": "f714a4b1160c694e270d9191a9f133e53856e2a1c62f5cd2f85740f7c2692397",
        "qwen3.eager_attention_forward": "cb34ccea28710ae8d5d94a241b704ea3d974048f85372f0b1b3c2a8a2ef1ee20",
        "qwen3.repeat_kv": "e9b1ad4a8df3194d5b12f94567c3a2dfed2c0d9833af1b8f775e5875575ff9c4",
        "masking_utils.eager_mask": "0ab0b7aa8e039a2c9fe1e242801c06256f0f3e0db510c85be85753565f878cc7",
        "masking_utils._ignore_causal_mask_sdpa": "60d5f943b631711f632e335ccf1f4a710537fe3eda9dc28b31478dffa8abdf1c",
        "sdpa_attention.sdpa_attention_forward": "6a965ca3df2d5f0856625f6259718f9645cfc4ab54e2bd56173af4faa3f056e4",
    }),
}  # fmt: skip


INSTALLED = transformers.__version__  # (read once: importing a submodule replaces the `transformers` module object)


def series(version: str) -> str:
    """The series of a release: 5.10.4 -> 5.10."""
    return ".".join(version.split(".")[:2])


def supported_release() -> Release:
    """The installed Transformers' `Release`, or a refusal that names the supported releases."""
    if series(INSTALLED) not in RELEASES:
        supported = ", ".join(release.verified for release in RELEASES.values())
        raise RuntimeError(
            f"rla_lib.align supports transformers {supported} (and the patch releases of these series whose Qwen2/Qwen3 "
            f"code is the same), not {INSTALLED}. Install one of them, e.g. pip install "
            f"transformers=={list(RELEASES.values())[-1].verified}."
        )
    return RELEASES[series(INSTALLED)]
