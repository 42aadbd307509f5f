"""What another user of the machine could run: watch /proc/net/tcp for new listening ports on
127.0.0.1 and connect to each the moment it appears, holding the connections.

Usage: python snatch_ports.py SECONDS PID   (prints READY once it knows the ports that were there before)

Only ports that process PID listens on are taken (the test's own store), so that jobs of other
tests running meanwhile are left alone.
"""
import os
import socket
import sys
import time


def listening(owner_inodes):
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            if fields[3] == "0A" and fields[1].startswith("0100007F:") and fields[9] in owner_inodes:
                yield int(fields[1].split(":")[1], 16)  # LISTEN, on 127.0.0.1, the owner's


def inodes_of(pid):
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                found.add(link[len("socket:["):-1])
    except OSError:
        pass
    return found


seconds, owner = float(sys.argv[1]), int(sys.argv[2])
before, tried, held = set(listening(inodes_of(owner))), set(), []
print("READY", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    for port in listening(inodes_of(owner)):
        if port not in before and port not in tried:
            tried.add(port)
            sock = socket.socket()
            sock.setblocking(False)
            try:
                sock.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            except OSError:
                continue
            held.append(sock)
