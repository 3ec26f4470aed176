#!/usr/bin/env bash
# Joins the pieces, checks them, starts s30.sh in its own session, then polls.
n=$(ls /tmp/pieces 2>/dev/null | wc -l); [ "$n" = 32 ] || { echo "pieces: $n of 32"; ls /tmp/pieces; exit 3; }
mkdir -p /tmp/models && cat /tmp/pieces/pair.* > /tmp/pair.bin || exit 3
head -c 1117320768 /tmp/pair.bin > /tmp/models/target.gguf && tail -c +1117320769 /tmp/pair.bin > /tmp/models/draft.gguf
rm -rf /tmp/pair.bin /tmp/pieces
sha256sum -c - <<SUMS || exit 3
cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046  /tmp/models/target.gguf
1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32  /tmp/models/draft.gguf
SUMS
mkdir -p /tmp/repo && tar --exclude=./models -cf - . | tar -xf - -C /tmp/repo && cp device_carry/poll.sh /tmp/poll.sh
cd /tmp/repo && setsid nohup bash device_carry/s30.sh > /tmp/launch.log 2>&1 < /dev/null &
sleep 2; cat /tmp/launch.log
bash /tmp/poll.sh ${1:-520}
