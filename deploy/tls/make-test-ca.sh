#!/usr/bin/env bash
# Makes a throwaway certificate authority and, signed by it, a server certificate for
# nats-server and a client certificate for provledger (mutual TLS). The tests run it;
# operators can copy it to try TLS, but should issue production certificates from their
# own CA.
#
# Usage: deploy/tls/make-test-ca.sh OUT_DIR [SERVER_NAME ...]
#   OUT_DIR      where ca.pem, server.pem, server-key.pem, client.pem, client-key.pem go
#   SERVER_NAME  DNS names of the servers (default: localhost); 127.0.0.1 is always added
# Needs: openssl. Keys are EC P-256; certificates are valid for 30 days.
set -euo pipefail
out="${1:?usage: make-test-ca.sh OUT_DIR [SERVER_NAME ...]}"
shift
names=("${@:-localhost}")
mkdir -p "$out"
cd "$out"
umask 077

san="IP:127.0.0.1"
for n in "${names[@]}"; do san="$san,DNS:$n"; done

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

key ca-key.pem
openssl req -x509 -new -key ca-key.pem -sha256 -days 30 -subj "/CN=provledger test CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -out ca.pem

issue() { # name, subject CN, extensions
  key "$1-key.pem"
  openssl req -new -key "$1-key.pem" -subj "/CN=$2" -out "$1.csr"
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days 30 \
    -sha256 -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

issue server "${names[0]}" "subjectAltName=$san
extendedKeyUsage=serverAuth
keyUsage=critical,digitalSignature"
issue client "provledger" "extendedKeyUsage=clientAuth
keyUsage=critical,digitalSignature"
rm -f ca.srl
chmod 0644 ca.pem server.pem client.pem
echo "wrote $(pwd)/{ca.pem,server.pem,server-key.pem,client.pem,client-key.pem}"
