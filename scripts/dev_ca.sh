#!/usr/bin/env bash
# Development certificates for TLS and mutual TLS between the dflash services (NOT for production).
#
#   scripts/dev_ca.sh OUT_DIR [NAME ...]
#
# Writes into OUT_DIR (created; existing files are replaced):
#   ca.crt  ca.key          a local certificate authority (trust ca.crt, keep ca.key private)
#   server.crt server.key   one server certificate for target, draft and gateway; its names:
#                           localhost, 127.0.0.1, ::1 and every NAME given (e.g. the
#                           docker-compose service names: target draft gateway)
#   client.crt client.key   a client certificate (CN dflash-gateway) for mutual TLS: the gateway
#                           presents it to the target and the draft
#   other-ca.crt            an unrelated CA, for tests that a wrong CA is refused
# Keys are ECDSA P-256, certificates valid 825 days. Uses only openssl (>= 1.1.1).
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
out="$1"; shift
mkdir -p "$out"
cd "$out"
umask 077
days=825

san="DNS:localhost,IP:127.0.0.1,IP:::1"
for name in "$@"; do
  if [[ "$name" =~ ^[0-9.]+$ || "$name" == *:* ]]; then san+=",IP:$name"; else san+=",DNS:$name"; fi
done

key() { openssl ecparam -name prime256v1 -genkey -noout -out "$1" 2>/dev/null; }

# the CA
key ca.key
openssl req -x509 -new -key ca.key -sha256 -days "$days" -subj "/CN=dflash development CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -out ca.crt

# sign NAME CN EXTENSIONS: NAME.key + NAME.csr -> NAME.crt signed by the CA
sign() {
  key "$1.key"
  openssl req -new -key "$1.key" -subj "/CN=$2" -out "$1.csr"
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 \
    -days "$days" -extfile "$1.ext" -out "$1.crt" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

sign server "dflash server" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=$san"

sign client "dflash-gateway" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"

# an unrelated CA (tests: a client trusting it must not reach the services)
key other-ca.key
openssl req -x509 -new -key other-ca.key -sha256 -days "$days" -subj "/CN=some other CA" \
  -addext "basicConstraints=critical,CA:TRUE" -out other-ca.crt
rm -f other-ca.key ca.srl
chmod 644 ./*.crt

openssl verify -CAfile ca.crt server.crt client.crt >/dev/null
echo "wrote $(pwd): ca.crt ca.key server.crt server.key client.crt client.key other-ca.crt"
echo "server names: $san"
