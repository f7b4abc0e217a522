#!/bin/sh
# Provisions TLS for the injection webhook without cert-manager: a private CA and a
# serving certificate for flowlane-webhook.flowlane-system.svc, stored in the Secret
# flowlane-webhook-tls, and the CA put into the MutatingWebhookConfiguration's caBundle.
# Run after `kubectl apply -k deploy/kubernetes`; re-run to rotate (then
# `kubectl -n flowlane-system rollout restart deploy/flowlane-webhook`).
set -eu
NS=${NS:-flowlane-system}
SVC=${SVC:-flowlane-webhook}
DAYS=${DAYS:-825}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
openssl req -x509 -newkey rsa:2048 -nodes -days "$DAYS" -subj "/CN=flowlane-webhook-ca" \
  -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=$SVC.$NS.svc" \
  -keyout "$dir/tls.key" -out "$dir/tls.csr" 2>/dev/null
printf 'subjectAltName=DNS:%s,DNS:%s.%s,DNS:%s.%s.svc\nextendedKeyUsage=serverAuth\n' \
  "$SVC" "$SVC" "$NS" "$SVC" "$NS" > "$dir/ext.cnf"
openssl x509 -req -in "$dir/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
  -days "$DAYS" -extfile "$dir/ext.cnf" -out "$dir/tls.crt" 2>/dev/null
kubectl -n "$NS" create secret tls "$SVC-tls" --cert="$dir/tls.crt" --key="$dir/tls.key" \
  --dry-run=client -o yaml | kubectl apply -f -
ca=$(base64 < "$dir/ca.crt" | tr -d '\n')
kubectl patch mutatingwebhookconfiguration flowlane-inject --type=json -p "[
  {\"op\":\"replace\",\"path\":\"/webhooks/0/clientConfig/caBundle\",\"value\":\"$ca\"},
  {\"op\":\"replace\",\"path\":\"/webhooks/1/clientConfig/caBundle\",\"value\":\"$ca\"}]"
echo "webhook TLS provisioned (CA valid $DAYS days)"
