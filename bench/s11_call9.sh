#!/usr/bin/env bash
# Session 11, call 9: W5a with the page cache dropped (the weights from the drive) against the drive's read rate.
set -u
source bench/s11_env.sh
ls -la /tmp/llama-3.1-8b | head; df -h /tmp | tail -1
# The drive's floor: one reader, then eight in parallel, over the weight files, caches dropped each time.
files=$(ls /tmp/llama-3.1-8b/*.safetensors)
bytes=$(cat $files | wc -c)
sync; echo 3 > /proc/sys/vm/drop_caches; t0=$(date +%s.%N); cat $files > /dev/null; t1=$(date +%s.%N)
python3 -c "print('drive, one reader: %.2f GB/s, %.2f s for %.2f GB' % ($bytes/($t1-$t0)/1e9, $t1-$t0, $bytes/1e9))"
sync; echo 3 > /proc/sys/vm/drop_caches; t0=$(date +%s.%N)
for f in $files; do python3 - "$f" <<'PY' &
import os, sys, threading
fd = os.open(sys.argv[1], os.O_RDONLY); size = os.fstat(fd).st_size; step = 64 << 20
def read(i):
    for off in range(i * step, size, 8 * step):
        os.pread(fd, step, off)
ts = [threading.Thread(target=read, args=(i,)) for i in range(8)]
[t.start() for t in ts]; [t.join() for t in ts]
PY
done; wait; t1=$(date +%s.%N)
python3 -c "print('drive, 8 threads per file: %.2f GB/s, %.2f s' % ($bytes/($t1-$t0)/1e9, $t1-$t0))"
for mode in --drop-caches ""; do
  timeout 150 python3 bench/hot_load.py /tmp/llama-3.1-8b --max-num-seqs 256 $mode 2>/dev/null | tail -1 > $OUT/w5a$mode.json
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); f=d['first']
print(d['page_cache'], 'first token %.2f s, ready %.2f s' % (d['first_token_s'], d['ready_s']), {k: round(v,3) if isinstance(v,float) else v for k,v in (f.get('load') or {}).items()}, 'replace %.2f s' % d['replace_first_token_s'])" $OUT/w5a$mode.json
done
