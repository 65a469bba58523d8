sed -i '/triton_setup.start(device)/d' services/worker/model_build.py && ! grep -q "triton_setup.start" services/worker/model_build.py
