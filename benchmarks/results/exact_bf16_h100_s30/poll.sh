#!/usr/bin/env bash
# Waits up to $1 seconds for the run to finish, then packs what it has into $OUT.
res=/tmp/res
[ -f $res/run.log ] || { echo "no run.log: a fresh machine"; exit 3; }
end=$((SECONDS + ${1:-540}))
while [ $SECONDS -lt $end ]; do grep -q "ALL DONE" $res/run.log && break; sleep 5; done
tail -25 $res/run.log
tar -C /tmp -cf - --exclude=res/prep/ckpt --exclude='*.tar' res | xz -T8 -3 > $OUT/res.tar.xz
ls -la $OUT; grep -q "ALL DONE" $res/run.log && echo RUN_COMPLETE
