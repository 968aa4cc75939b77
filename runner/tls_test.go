package runner

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvepp/kvepp/extproc/extproctest"
)

// dialTLS connects to addr over TLS without verifying the server certificate, as Envoy does for
// the EPP's self-signed certificate.
func dialTLS(t testing.TB, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{InsecureSkipVerify: true})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// peerCertificate performs a TLS handshake with ALPN h2 and returns the negotiated protocol and
// the server's leaf certificate.
func peerCertificate(t testing.TB, addr string) (string, *x509.Certificate) {
	t.Helper()
	c, err := tls.Dial("tcp", addr, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	st := c.ConnectionState()
	return st.NegotiatedProtocol, st.PeerCertificates[0]
}

func writePair(t testing.TB, dir string, cert tls.Certificate) {
	t.Helper()
	keyDER, err := x509.MarshalECPrivateKey(cert.PrivateKey.(*ecdsa.PrivateKey))
	if err != nil {
		t.Fatal(err)
	}
	crt := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Certificate[0]})
	key := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
	// Write the key first and the certificate last, each atomically, as cert-manager style tools do.
	for _, f := range []struct {
		name string
		data []byte
	}{{"tls.key", key}, {"tls.crt", crt}} {
		tmp := filepath.Join(dir, "."+f.name+".tmp")
		if err := os.WriteFile(tmp, f.data, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, f.name)); err != nil {
			t.Fatal(err)
		}
	}
}

func TestSecureServing(t *testing.T) {
	t.Run("without a cert path a self-signed ECDSA certificate with ALPN h2 serves ext_proc and health", func(t *testing.T) {
		cfg := loopbackConfig(t)
		cfg.SecureServing = true
		inst := startInstance(t, cfg)

		proto, leaf := peerCertificate(t, inst.Addrs().GRPC)
		if proto != "h2" {
			t.Fatalf("ALPN negotiated %q, want h2", proto)
		}
		if _, ok := leaf.PublicKey.(*ecdsa.PublicKey); !ok {
			t.Fatalf("certificate key is %T, want ECDSA", leaf.PublicKey)
		}
		if !bytes.Equal(leaf.RawIssuer, leaf.RawSubject) {
			t.Fatal("certificate is not self-signed")
		}

		conn := dialTLS(t, inst.Addrs().GRPC)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		r, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "envoy.service.ext_proc.v3.ExternalProcessor"})
		if err != nil || r.Status != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("health over TLS: %v %v", r, err)
		}
		// No workers are registered: a header-only request reaches the server over TLS and gets
		// the clean 503 of a load-only pick without candidates (epp.md §5.7, §8).
		ex, err := extproctest.NewClient(conn).Do(ctx, extproctest.Request{Method: "GET", Path: "/v1/models", HeaderOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		if ex.Immediate == nil || ex.Immediate.Status != 503 {
			t.Fatalf("want a 503 ImmediateResponse, got %+v (destination %q)", ex.Immediate, ex.Destination)
		}

		// The health port stays plaintext.
		hr, err := healthpb.NewHealthClient(dialPlain(t, inst.Addrs().Health)).Check(ctx, &healthpb.HealthCheckRequest{Service: "liveness"})
		if err != nil || hr.Status != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("plaintext health port: %v %v", hr, err)
		}
	})

	t.Run("a cert path serves its pair and reloads it when the files change", func(t *testing.T) {
		dir := t.TempDir()
		first, err := SelfSignedCertificate("first.kvepp.test")
		if err != nil {
			t.Fatal(err)
		}
		writePair(t, dir, first)
		cfg := loopbackConfig(t)
		cfg.SecureServing = true
		cfg.CertPath = dir
		inst := startInstance(t, cfg)

		_, leaf := peerCertificate(t, inst.Addrs().GRPC)
		if !bytes.Equal(leaf.Raw, first.Certificate[0]) {
			t.Fatal("served certificate is not tls.crt")
		}
		second, err := SelfSignedCertificate("second.kvepp.test")
		if err != nil {
			t.Fatal(err)
		}
		writePair(t, dir, second)
		deadline := time.Now().Add(5 * time.Second)
		for {
			_, leaf = peerCertificate(t, inst.Addrs().GRPC)
			if bytes.Equal(leaf.Raw, second.Certificate[0]) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("certificate not reloaded within 5 s")
			}
			time.Sleep(100 * time.Millisecond)
		}
	})

	t.Run("a cert path without a valid pair stops startup naming DYN_EPP_CERT_PATH", func(t *testing.T) {
		cfg := loopbackConfig(t)
		cfg.SecureServing = true
		cfg.CertPath = t.TempDir()
		_, err := Start(context.Background(), Options{Config: cfg, Logger: testLogger(t)})
		if err == nil || !bytes.Contains([]byte(err.Error()), []byte("invalid DYN_EPP_CERT_PATH")) {
			t.Fatalf("error = %v", err)
		}
	})
}
