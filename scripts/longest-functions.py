#!/usr/bin/env python3
"""The longest functions of the product (events, projections, services/*/src), by lines
from `fn` to its closing brace. Unit tests (`tests.rs`, `#[cfg(test)]` modules) and
integration tests are not the product. Usage: scripts/longest-functions.py [N]"""
import os, re, sys

ROOTS = ["events/src", "projections/src", "services/client/src", "services/serve/src",
         "services/cli/src", "services/sim/src"]
FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s+(\w+)")

def strip(line, state):
    """The line's code, without strings, chars and comments (state: in a block comment
    or a raw string)."""
    out, i = [], 0
    while i < len(line):
        if state["block"]:
            j = line.find("*/", i)
            if j < 0:
                return "".join(out)
            state["block"] = False; i = j + 2; continue
        if state["raw"]:
            j = line.find('"' + "#" * state["raw_hashes"], i)
            if j < 0:
                return "".join(out)
            i = j + 1 + state["raw_hashes"]; state["raw"] = False; continue
        if state["str"]:
            while i < len(line):
                if line[i] == "\\": i += 2; continue
                if line[i] == '"': state["str"] = False; i += 1; break
                i += 1
            continue
        c = line[i]
        if line.startswith("//", i): break
        if line.startswith("/*", i): state["block"] = True; i += 2; continue
        m = re.match(r'r(#*)"', line[i:])
        if m and (i == 0 or not (line[i-1].isalnum() or line[i-1] == "_")):
            state["raw"] = True; state["raw_hashes"] = len(m.group(1)); i += len(m.group(0)); continue
        if c == '"': state["str"] = True; i += 1; continue
        if c == "'":
            m = re.match(r"'(\\.|[^\\'])'", line[i:]) or re.match(r"'\\u\{[0-9a-fA-F]+\}'", line[i:])
            if m: i += len(m.group(0)); continue
        out.append(c); i += 1
    return "".join(out)

def functions(path):
    lines = open(path).read().split("\n")
    state = {"block": False, "raw": False, "raw_hashes": 0, "str": False}
    code = [strip(l, state) for l in lines]
    found, skip_until = [], -1
    for n, l in enumerate(lines):
        if n <= skip_until: continue
        if l.strip().startswith("#[cfg(test)]"):
            # skip the item that follows (a module or a function)
            depth, started = 0, False
            for k in range(n + 1, len(lines)):
                depth += code[k].count("{") - code[k].count("}")
                if "{" in code[k]: started = True
                if started and depth <= 0: skip_until = k; break
                if not started and code[k].rstrip().endswith(";"): skip_until = k; break
            continue
        m = FN.match(code[n])
        if not m: continue
        depth, started = 0, False
        for k in range(n, len(lines)):
            if not started and ";" in code[k] and "{" not in code[k]: break  # a declaration
            depth += code[k].count("{") - code[k].count("}")
            if "{" in code[k]: started = True
            if started and depth <= 0:
                found.append((k - n + 1, f"{path}:{n+1}", m.group(6))); break
    return found

def main():
    top = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    allf = []
    for root in ROOTS:
        for d, dirs, files in os.walk(root):
            dirs[:] = [x for x in dirs if x not in ("tests", "benches")]
            for f in files:
                if f.endswith(".rs") and f != "tests.rs":
                    allf += functions(os.path.join(d, f))
    allf.sort(reverse=True)
    for lines, where, name in allf[:top]:
        print(f"{lines:5}  {name:36} {where}")
    print(f"functions: {len(allf)}, over 100 lines: {sum(1 for l,_,_ in allf if l > 100)}")

main()
