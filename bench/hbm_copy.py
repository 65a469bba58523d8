"""The measured HBM copy rate, TB/s (read + write of a 2 GiB device-to-device copy): the rooflines' denominator."""

import torch

a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
b = torch.empty_like(a)
for _ in range(3):
    b.copy_(a)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(10):
    b.copy_(a)
end.record()
torch.cuda.synchronize()
print(2 * 10 * a.numel() / (start.elapsed_time(end) / 1e3) / 1e12)
