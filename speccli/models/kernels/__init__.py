"""CPU kernels and quantization: which kernels run a pass on this processor, int8 drafts,
torchao on CUDA, precise logits, whether llama.cpp's repacked kernels run here."""
