sed -i 's/else scratch.layers\[:2\]/else scratch.layers/' services/worker/engine/gpu_memory.py && ! grep -q "layers\[:2\]" services/worker/engine/gpu_memory.py
