"""samba-hf's `SambaConfig` as vLLM reads it: one more name, `mamba_chunk_size`, for the Mamba-2 chunk size (samba-hf
calls it `mamba2_chunk_size`; without it vLLM chunks the SSD scan by 2048 tokens instead of the model's own)."""

from .configuration_samba import SambaConfig


class ServedSambaConfig(SambaConfig):
    @property
    def mamba_chunk_size(self) -> int | None:
        return self.mamba2_chunk_size if self.mamba_version == 2 else None
