package runner

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/rs/zerolog"
)

// SelfSignedCertificate generates an ECDSA P-256 certificate valid for one year for localhost,
// 127.0.0.1, ::1 and the host names given (epp.md §1: "self-signed unless a cert is given").
func SelfSignedCertificate(hosts ...string) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("generate TLS key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("generate certificate serial: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{Organization: []string{"kvepp"}, CommonName: "kvepp-epp"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		DNSNames:              []string{"localhost"},
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
	}
	for _, h := range hosts {
		if h == "" {
			continue
		}
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("create self-signed certificate: %w", err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("parse self-signed certificate: %w", err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, nil
}

// certReloader serves tls.crt/tls.key from a directory and reloads them when either file's size or
// modification time changes (checked at most once per second, at handshake time). A reload that
// fails keeps the previous pair and logs the error.
type certReloader struct {
	dir string
	log zerolog.Logger

	mu        sync.Mutex
	cert      *tls.Certificate
	stamp     string
	lastCheck time.Time
}

// newCertReloader loads the pair once; a missing or invalid pair is a startup error naming
// DYN_EPP_CERT_PATH.
func newCertReloader(dir string, log zerolog.Logger) (*certReloader, error) {
	r := &certReloader{dir: dir, log: log}
	cert, stamp, err := r.load()
	if err != nil {
		return nil, fmt.Errorf("invalid DYN_EPP_CERT_PATH %q: %w", dir, err)
	}
	r.cert, r.stamp, r.lastCheck = cert, stamp, time.Now()
	return r, nil
}

func (r *certReloader) paths() (string, string) {
	return filepath.Join(r.dir, "tls.crt"), filepath.Join(r.dir, "tls.key")
}

// fileStamp identifies the current versions of both files.
func (r *certReloader) fileStamp() (string, error) {
	crt, key := r.paths()
	var stamp string
	for _, p := range []string{crt, key} {
		st, err := os.Stat(p)
		if err != nil {
			return "", err
		}
		stamp += fmt.Sprintf("%s:%d:%d;", p, st.Size(), st.ModTime().UnixNano())
	}
	return stamp, nil
}

func (r *certReloader) load() (*tls.Certificate, string, error) {
	stamp, err := r.fileStamp()
	if err != nil {
		return nil, "", err
	}
	crt, key := r.paths()
	cert, err := tls.LoadX509KeyPair(crt, key)
	if err != nil {
		return nil, "", err
	}
	return &cert, stamp, nil
}

// GetCertificate implements tls.Config.GetCertificate.
func (r *certReloader) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if time.Since(r.lastCheck) >= time.Second {
		r.lastCheck = time.Now()
		if stamp, err := r.fileStamp(); err == nil && stamp != r.stamp {
			cert, newStamp, err := r.load()
			if err != nil {
				r.log.Error().Err(err).Str("cert_path", r.dir).Msg("TLS certificate reload failed; keeping the previous certificate")
			} else {
				r.cert, r.stamp = cert, newStamp
				r.log.Info().Str("cert_path", r.dir).Msg("TLS certificate reloaded")
			}
		}
	}
	if r.cert == nil {
		return nil, errors.New("no TLS certificate loaded")
	}
	return r.cert, nil
}

// serverTLSConfig builds the ext_proc listener's TLS configuration: the pair from certPath
// (reloaded on change) or, when certPath is empty, a freshly generated self-signed certificate
// (logged as a warning). ALPN offers h2 (gRPC).
func serverTLSConfig(certPath string, log zerolog.Logger) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"h2"}}
	if certPath != "" {
		r, err := newCertReloader(certPath, log)
		if err != nil {
			return nil, err
		}
		cfg.GetCertificate = r.GetCertificate
		return cfg, nil
	}
	host, _ := os.Hostname()
	cert, err := SelfSignedCertificate(host)
	if err != nil {
		return nil, err
	}
	log.Warn().Msg("DYN_EPP_SECURE_SERVING is on and DYN_EPP_CERT_PATH is unset: serving ext_proc with a generated self-signed certificate (configure the proxy to skip verification, or set DYN_EPP_CERT_PATH)")
	cfg.Certificates = []tls.Certificate{cert}
	return cfg, nil
}
